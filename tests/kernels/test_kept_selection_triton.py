"""The kept selection's fused pack check and expansion (indexer/kept_selection.py) in Triton's
interpreter: the same kept tensors and the same selection back as the PyTorch passes of
genolong/model/kept_selection.py, for rows that pack (with empty pools), rows that do not (a pool
out of order inside a group, a stray negative), no tail, a tail, and a pool count that is not a
power of two."""

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.interpreted import run_cases  # noqa: E402

from genolong.errors import GenolongError
from genolong.kernels.indexer import kept_selection as kept_selection_triton

_INTERPRETED = r"""
import json, sys
import torch
from genolong.model import kept_selection as ks
import genolong.kernels as kernels

kernels.load()  # installs the fused passes (the interpreter counts as their device)
fused = dict(ks.FUSED)

def both(fn):
    ks.FUSED.clear()
    want = fn()
    ks.FUSED.update(fused)
    got = fn()
    return want, got

for case in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(case["seed"])
    rows, topk, kpool, tail_w, n_pools = case["rows"], case["topk"], case["kpool"], case["tail"], case["n_pools"]
    pools = torch.stack([torch.randperm(n_pools, generator=g)[:topk].sort().values for _ in range(rows)]).int()
    pools[torch.rand(pools.shape, generator=g) < 0.2] = -1
    body = (pools[..., None] * kpool + torch.arange(kpool, dtype=torch.int32)).masked_fill(pools[..., None] < 0, -1).flatten(-2)
    tail = torch.randint(-1, n_pools * kpool, (rows, tail_w), generator=g, dtype=torch.int32)
    idx = torch.cat([body, tail], -1).view(1, rows, -1)
    if case.get("swap"):
        idx[0, 1, 4], idx[0, 1, 5] = idx[0, 1, 5].item(), idx[0, 1, 4].item()   # two slots of one group swapped
    if case.get("stray"):
        idx[0, 2, 0] = -5
    want, got = both(lambda: ks.pack_selection(idx, kpool=kpool, topk_pools=topk))
    same = len(want) == len(got) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got))
    back_want, back_got = both(lambda: ks.unpack_selection(want, kpool=kpool))
    print("RESULT " + json.dumps(dict(name=case["name"], packed=len(want) == 2, same_kept=same,
                                      same_back=bool(torch.equal(back_want, back_got)), round_trip=bool(torch.equal(back_got, idx)),
                                      fused_installed=bool(fused))), flush=True)
"""

CASES = [
    dict(name="packs, tail of 3", seed=1, rows=6, topk=8, kpool=4, tail=3, n_pools=40),
    dict(name="packs, no tail, 6 pools", seed=2, rows=5, topk=6, kpool=4, tail=0, n_pools=20),
    dict(name="packs, kpool 2, 512 pools", seed=3, rows=3, topk=512, kpool=2, tail=1, n_pools=2048),
    dict(name="a group out of order", seed=4, rows=4, topk=8, kpool=4, tail=3, n_pools=40, swap=True),
    dict(name="a stray negative", seed=5, rows=4, topk=8, kpool=4, tail=3, n_pools=40, stray=True),
]


@pytest.fixture(scope="module")
def interpreted():
    return run_cases(_INTERPRETED, CASES, {kept_selection_triton.ENV: "triton"})


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_fused_passes_keep_and_give_back_what_the_pytorch_ones_do(interpreted, name):
    r = interpreted[name]
    assert r["fused_installed"] and r["same_kept"] and r["same_back"] and r["round_trip"], r
    assert r["packed"] == (not any(k in name for k in ("out of order", "stray"))), r


def test_only_int32_selections_with_power_of_two_pools_take_the_fused_passes_when_asked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(kept_selection_triton.ENV, raising=False)
    t = torch.zeros(2, 7, dtype=torch.int32)
    assert kept_selection_triton.enabled(t, 4)  # the default
    monkeypatch.setenv(kept_selection_triton.ENV, "triton")
    assert kept_selection_triton.enabled(t, 4) and not kept_selection_triton.enabled(t, 3)
    assert not kept_selection_triton.enabled(t.long(), 4)
    monkeypatch.setenv(kept_selection_triton.ENV, "torch")
    assert not kept_selection_triton.enabled(t, 4)
    monkeypatch.setenv(kept_selection_triton.ENV, "fast")
    with pytest.raises(GenolongError, match="GENOLONG_KEPT_SELECTION='fast' is not a setting; set it to one of triton, torch"):
        kept_selection_triton.enabled(t, 4)
