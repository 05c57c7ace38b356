"""The fused row bounds of the key-chunked sparse backward (sparse_mla/chunk_bounds.py) in Triton's
interpreter: the same bounds and the same "rows ascend" answer as the PyTorch passes of
sparse_mla.ascending_bounds_reference, on rows with empty slots first, inside and last, all-empty rows, widths
that are not a power of two, keys on the chunk edges, and rows that do not ascend."""

import pytest

pytest.importorskip("triton")

from tests.kernels.interpreted import run_cases  # noqa: E402

_INTERPRETED = r"""
import json, sys
import torch
from genolong.kernels.sparse_mla import chunk_bounds as chunk_bounds_triton
from genolong.kernels.sparse_mla import op as sparse_mla

def torch_form(idx, edges):
    # The PyTorch passes: the suffix-minimum ranges even for rows that do not ascend.
    bounds, ascends = sparse_mla.ascending_bounds_reference(idx, edges)
    return bounds, bool(ascends)

for case in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(case["seed"])
    rows, width, keys, chunk = case["rows"], case["width"], case["keys"], case["chunk"]
    idx = torch.randint(0, keys, (rows, width), generator=g, dtype=torch.int32)
    if case["ascending"]:
        idx = idx.sort(dim=-1).values
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    idx[0] = -1                      # an empty row
    idx[1, -3:] = -1                 # trailing empties
    idx[2, 0] = chunk if width > 1 and chunk < keys else idx[2, 0]   # a key on a chunk edge
    if case["ascending"]:
        idx[2] = torch.where(idx[2] >= 0, idx[2].clamp(min=0).sort().values, idx[2])  # keep it ascending
        idx[2] = torch.where(idx[2] < 0, -1, idx[2].cummax(0).values)
    if case.get("break_row") is not None:
        r = case["break_row"]
        idx[r, 0], idx[r, -1] = keys - 1, 0   # one row that does not ascend
    edges = torch.arange(0, keys + chunk, chunk, dtype=torch.int32)
    want_bounds, want_ascends = torch_form(idx, edges)
    got_bounds, got_flag = chunk_bounds_triton.ascending_bounds(idx, edges)
    print("RESULT " + json.dumps(dict(name=case["name"], same_bounds=bool(torch.equal(got_bounds, want_bounds)),
                                      ascends=bool(got_flag), want_ascends=want_ascends,
                                      dtype=str(got_bounds.dtype), flag_dtype=str(got_flag.dtype))), flush=True)
"""

CASES = [
    dict(name="ascending, W 19, 7 chunks", seed=1, rows=9, width=19, keys=50, chunk=8, ascending=True),
    dict(name="ascending, W 2051 (the model's), 9 chunks", seed=2, rows=5, width=2051, keys=4096, chunk=512, ascending=True),
    dict(name="one row breaks the order", seed=3, rows=6, width=33, keys=64, chunk=16, ascending=True, break_row=4),
    dict(name="random rows", seed=4, rows=7, width=12, keys=40, chunk=8, ascending=False),
    dict(name="one chunk", seed=5, rows=4, width=8, keys=16, chunk=16, ascending=True),
]


@pytest.fixture(scope="module")
def interpreted():
    return run_cases(_INTERPRETED, CASES)


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_fused_bounds_equal_the_pytorch_passes(interpreted, name):
    r = interpreted[name]
    assert r["same_bounds"] and r["dtype"] == "torch.int32" and r["flag_dtype"] == "torch.bool", r
    assert r["ascends"] == r["want_ascends"], r


def test_the_cases_include_rows_that_do_not_ascend(interpreted):
    assert not interpreted["one row breaks the order"]["want_ascends"]
    assert not interpreted["random rows"]["want_ascends"]
    assert interpreted["ascending, W 2051 (the model's), 9 chunks"]["want_ascends"]
