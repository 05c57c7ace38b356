"""The selection kernels' in-register top-k (`indexer_triton._top_narrow`) against a sort: the same
entries chosen, in the same slots.

The reference orders entries by the documented key (fp32 bit pattern made order-preserving, so
-0.0 sorts below +0.0; -inf and NaN are never chosen) and breaks ties by the lower index; chosen
entries take slots in index order. It uses torch's stable sort, not the kernels' bit search."""

import importlib.util

import pytest

from tests.kernels.interpreted import run_script

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_INTERPRETED = r"""
import torch, triton, triton.language as tl
from genolong.kernels.indexer import triton_kernels as it

@triton.jit
def _probe(s_ptr, chosen_ptr, slot_ptr, take_ptr, n, N: tl.constexpr, TOPK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N)
    s = tl.load(s_ptr + row * n + i, mask=i < n, other=float("-inf"))
    chosen, slot, take = it._top_narrow(s, TOPK)
    tl.store(chosen_ptr + row * N + i, chosen.to(tl.int32))
    tl.store(slot_ptr + row * N + i, tl.where(chosen, slot, -1))
    tl.store(take_ptr + row, take)

def kernel(s, topk):
    rows, n = s.shape
    N = max(16, triton.next_power_of_2(n))
    chosen = torch.empty(rows, N, dtype=torch.int32)
    slot = torch.empty(rows, N, dtype=torch.int32)
    take = torch.empty(rows, dtype=torch.int32)
    _probe[(rows,)](s, chosen, slot, take, n, N=N, TOPK=topk)
    return slot[:, :n], take

def reference(s, topk):
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    valid = s > float("-inf")
    key = torch.where(valid, key, -1)
    slot = torch.full(s.shape, -1, dtype=torch.int32)
    take = torch.minimum(valid.sum(1), torch.tensor(topk)).int()
    for r in range(s.shape[0]):
        order = torch.sort(key[r], descending=True, stable=True).indices[: int(take[r])]
        picked = torch.sort(order).values
        slot[r, picked] = torch.arange(len(picked), dtype=torch.int32)
    return slot, take

torch.manual_seed(0)
n = 300
s = torch.randn(16, n)
s[1] = 1.0                                   # every entry tied
s[2, 150:] = float("-inf")                   # fewer finite entries than some top-k
s[3] = float("-inf")                         # none
s[4, ::3] = 0.0; s[4, 1::3] = -0.0           # signed zeros: -0.0 below +0.0
s[5, :40] = 2.0                              # ties straddling the threshold
s[6] = -s[6].abs()                           # all negative
s[7, 5] = float("nan"); s[7, 9] = float("inf")
s[8] = torch.randint(-3, 4, (n,)).float()    # few distinct values, many ties
s[9] = torch.randn(n).to(torch.bfloat16).float()
s[10, 100:] = float("-inf"); s[10, :100] = 7.0
s[11] = torch.linspace(-1, 1, n)             # adjacent floats far apart: the search stops early
s[12] = 1.0 + torch.arange(n) * 2.0 ** -23   # neighbouring floats: the search runs to the last bit
bad = []
for topk in (1, 16, 37, 100, 150, 299, 512):
    want_slot, want_take = reference(s, topk)
    slot, take = kernel(s, topk)
    for r in range(s.shape[0]):
        if not (torch.equal(slot[r], want_slot[r]) and int(take[r]) == int(want_take[r])):
            bad.append((topk, r))
print("MISMATCHED", bad)
"""


@needs_triton
@pytest.mark.slow(seconds=15)
def test_the_top_k_chooses_what_a_stable_sort_chooses():
    run = run_script(_INTERPRETED)
    assert "MISMATCHED []" in run.stdout, run.stdout + run.stderr[-3000:]


@needs_triton
@pytest.mark.parametrize("seq", [1 << 17, 1 << 19])
def test_the_selection_kernels_build_for_sm90_without_spills_in_few_registers(seq):
    # The uint32 keys are the point: an int64 build of the group selection took ~224 registers a
    # thread (an SM held two 4-warp programs).
    from genolong.kernels import aot
    from genolong.kernels.indexer import triton_kernels as it

    usage = {name: aot.ptxas_usage(k) for name, k in it.aot_compile_v2(4, 128, 4, 4, seq=seq).items() if name.startswith("select")}
    for name, (regs, spilled) in usage.items():
        assert spilled == 0, (name, regs)
    assert usage["select_groups"][0] <= 192, usage
