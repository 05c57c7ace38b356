"""The fused policy runs indexer v2 for every head count (the streamed pass 1 for more heads than
the resident kernel holds, proven on the H200 on 2026-12-03), with its own group size."""

import pytest
import torch

pytest.importorskip("triton")

from genolong.kernels.indexer import topk as indexer_topk
from genolong.kernels.indexer import triton_kernels as indexer_triton


def _q(heads):
    return torch.zeros(1, 8, heads, 128, dtype=torch.bfloat16)


def test_v2_runs_every_head_count_with_its_own_group_size(monkeypatch):
    assert not indexer_triton.q_resident(32, 128, indexer_triton.BM2) and indexer_triton.q_resident(4, 128, indexer_triton.BM2)
    seen = []
    monkeypatch.setattr(indexer_topk, "_check", lambda *a: None)  # CUDA-only check; the call itself is captured
    monkeypatch.setattr(indexer_topk, "indexer_fused_select", lambda *a, group, **kw: seen.append(group))
    kw = dict(kpool=4, topk_pools=2, always_select_tail=True, softmax_scale=1.0)
    for heads in (4, 32):
        args = (_q(heads), torch.zeros(1, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 8, heads))
        indexer_topk.dsa_indexer_topk_fused_select(*args, **kw)
    assert seen == [4, 4] and indexer_topk.V2_GROUP == 4
