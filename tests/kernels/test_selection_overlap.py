"""benchmarks/probe_selection_overlap.py: the distinct keys of a query group's selections, the
figure that decided against a union sparse-MLA backward (docs/kernels.md)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from probe_selection_overlap import distinct_keys, minhash_order, overlap  # noqa: E402

from genolong.errors import GenolongError  # noqa: E402


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_distinct_keys_are_the_size_of_each_groups_key_set(group):
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(60, generator=g)[:9] for _ in range(12)]).int()
    idx[idx > 45] = -1
    counts = distinct_keys(idx, group, budget_bytes=200)  # several pieces
    for k in range(12 // group):
        keys = {j for row in idx[k * group:(k + 1) * group].tolist() for j in row if j >= 0}
        assert counts[k].item() == len(keys)


def test_the_ratio_is_the_group_size_for_identical_rows_and_one_for_disjoint_rows():
    same = torch.arange(8, dtype=torch.int32).repeat(8, 1)
    assert overlap(same, 4)["ratio"] == 4.0
    disjoint = torch.arange(64, dtype=torch.int32).view(8, 8)
    assert overlap(disjoint, 4)["ratio"] == 1.0


def test_minhash_order_is_a_permutation_that_puts_equal_selections_together():
    a, b = torch.arange(0, 8, dtype=torch.int32), torch.arange(100, 108, dtype=torch.int32)
    idx = torch.stack([a, b, a, b, a, b, a, b])
    order = minhash_order(idx)
    assert sorted(order.tolist()) == list(range(8))
    assert overlap(idx, 2)["ratio"] == 1.0 and overlap(idx[order], 2)["ratio"] == 2.0


def test_bad_input_is_named():
    with pytest.raises(GenolongError, match="int32"):
        distinct_keys(torch.zeros(4, 3), 2)
    with pytest.raises(GenolongError, match="divide the 5 rows"):
        distinct_keys(torch.zeros(5, 3, dtype=torch.int32), 2)
