"""benchmarks/dkv_adds_probe.py (a GPU benchmark's probe): the pairs' order, and the adds it times, in
Triton's interpreter against a count of the keys; the sm_90 build of its layout adds."""

import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.interpreted import run_cases

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

_SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(BENCH)!r})
import torch
from dkv_adds_probe import dkv_adds

for name, c in json.loads(sys.argv[1]).items():
    g = torch.Generator().manual_seed(len(name))
    keys = torch.randint(-1, c["rows"], (c["pairs"],), generator=g, dtype=torch.int32)
    dkv = torch.zeros(c["rows"], c["dim"])
    dkv_adds(keys, dkv, mode=c["mode"], values=c["values"], block_n=16, blocks=c["blocks"])
    print("RESULT", json.dumps(dict(name=name, dkv=dkv.tolist(), keys=keys.tolist())), flush=True)
"""

CASES = {
    # A partial last block, repeated keys in one block, empty slots (-1); blocks of 2 and 3 per program.
    "coalesced mma": dict(mode="coalesced", values="mma", rows=20, dim=32, pairs=101, blocks=2),
    "coalesced flat": dict(mode="coalesced", values="flat", rows=20, dim=32, pairs=70, blocks=3),
    "store flat": dict(mode="store", values="flat", rows=20, dim=32, pairs=50, blocks=2),
}


@pytest.fixture(scope="module")
def interpreted():
    return run_cases(_SCRIPT, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_the_probe_adds_16_per_pair_to_its_key_row(interpreted, name):
    r, c = interpreted[name], CASES[name]
    keys = torch.tensor(r["keys"])
    counts = torch.bincount(keys[keys >= 0].long(), minlength=c["rows"]).float()
    per_row = 16.0 * (counts if c["mode"] == "coalesced" else (counts > 0).float())
    assert (keys < 0).any() and counts.max() > 1  # the cases have empty slots and repeated keys
    assert torch.equal(torch.tensor(r["dkv"]), per_row[:, None].expand(-1, c["dim"]))


def test_pair_keys_follow_the_key_chunked_order():
    from dkv_adds_probe import pair_keys

    idx = torch.tensor([[[5, 1, -1, 9], [0, 8, 3, -1], [7, 2, 6, 4]]], dtype=torch.int32)  # 3 queries x 4 slots, 10 keys
    assert pair_keys(idx, "query", 4).tolist() == [5, 1, 9, 0, 8, 3, 7, 2, 6, 4]
    # Chunks of 4 keys: [0, 4) first, query by query, then [4, 8), then [8, 12).
    assert pair_keys(idx, "keychunk", 4).tolist() == [1, 0, 3, 2, 5, 7, 6, 4, 9, 8]
    with pytest.raises(ValueError, match="order must be one of keychunk, query"):
        pair_keys(idx, "random", 4)


def test_the_probe_refuses_what_it_cannot_time():
    from dkv_adds_probe import dkv_adds

    with pytest.raises(ValueError, match="mode must be one of coalesced, layout, store"):
        dkv_adds(torch.zeros(4, dtype=torch.int32), torch.zeros(4, 32), mode="max")
    with pytest.raises(ValueError, match="contiguous fp32"):
        dkv_adds(torch.zeros(4, dtype=torch.int32), torch.zeros(4, 32, dtype=torch.float16))


@pytest.mark.parametrize("mode", ["coalesced", "layout"])
def test_the_probe_builds_for_sm90_with_the_adds_it_names(mode):
    """The layout adds are inline PTX (no interpreter): their sm_90 build has the vector reds."""
    from dkv_adds_probe import MODES, _dkv_adds_kernel

    from genolong.kernels import aot

    kernel = aot.build(_dkv_adds_kernel, {"keys_ptr": "*i32", "dkv_ptr": "*fp32", "n_pairs": "i32"},
                       {"D": 512, "BN": 16, "BLOCKS": 16, "MODE": MODES[mode], "MMA": True}, num_warps=4)
    ptx = kernel.asm["ptx"]
    assert aot.ptxas_usage(kernel)[1] == 0  # no spills
    assert ("red.relaxed.gpu.global.add.v2.f32" in ptx) == (mode == "layout")
    assert "mma.sync" in ptx or "wgmma" in ptx  # the values come out of a tensor-core product
