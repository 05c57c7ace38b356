"""The few-head Triton sparse-MLA kernels on the CPU: run in Triton's interpreter against the
model's fp64 reference (outputs, lse and both gradients), and built for sm_90 without a GPU.

The interpreter has no bf16 (it returns garbage), so 16-bit cases use fp16; fp32 cases run the
kernels' exact-fp32 products and must agree to ~1e-6. Outputs start as NaN (POISON), so an
element no program wrote fails the comparison.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from genolong.errors import GenolongError
from genolong.kernels.sparse_mla import op as sparse_mla
from genolong.model.ops import KernelUnsupported

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, case): selections are "random" (any key in [0, S) or -1, duplicates allowed, one empty
# row) or "pools" (the indexer reference's pool-structured, causal selections, kpool 4 + tail).
CASES = {
    "fp32 random, 2 batches, one pass": dict(batch=2, seq=48, heads=4, dim=64, sel="random", width=37, dtype="float32"),
    # The backward stacks q and dO into one operand where at most half the head block is heads
    # (up to 8 heads with 16-row blocks); 16 and 80 heads run the unpacked pass.
    "fp16 pools, 8 heads (the most that pack) x 512, one pass":
        dict(batch=1, seq=64, heads=8, dim=512, sel="pools", topk_pools=8, dtype="float16"),
    "fp32 random, kv longer than q (CP), key chunks of 16, 4 query chunks":
        dict(batch=2, seq=40, kv_len=100, heads=3, dim=32, sel="random", width=29, dtype="float32",
             key_chunk=16, query_chunks=4),
    "fp32 80 heads: head blocks 64+16, backward 32+32+16":
        dict(batch=1, seq=24, heads=80, dim=32, sel="random", width=11, dtype="float32",
             configs={"fwd": [64, 32, 8, 5], "bwd": [32, 16, 8, 5]}),
    # On the GPU, the first call times candidate configs on its own rows, adding into dkv: the
    # trials (run here twice per kernel, as timed) must leave no trace in the results.
    "fp32 config trials, one pass": dict(batch=1, seq=40, heads=2, dim=32, sel="random", width=9, dtype="float32", trials=True),
    "fp32 config trials, key chunks": dict(batch=1, seq=40, heads=2, dim=32, sel="random", width=9, dtype="float32",
                                           key_chunk=8, trials=True),
    "fp32 one head, two slots": dict(batch=1, seq=16, heads=1, dim=16, sel="random", width=2, dtype="float32"),
    "fp16 pools, 8 heads x 512, key chunks of 32":
        dict(batch=1, seq=96, heads=8, dim=512, sel="pools", topk_pools=8, dtype="float16", key_chunk=32,
             configs={"fwd": [16, 64, 8, 5], "bwd": [16, 32, 8, 5]}),
    "fp16 pools, 16 heads x 512, one pass": dict(batch=1, seq=96, heads=16, dim=512, sel="pools", topk_pools=8, dtype="float16"),
    # Rows as the fused indexer writes them (keys ascending, empty slots anywhere): walked unsorted.
    "fp32 ascending rows with empty slots, key chunks of 8, 3 query chunks":
        dict(batch=2, seq=40, heads=4, dim=32, sel="ascending", width=13, dtype="float32", key_chunk=8,
             query_chunks=3),
    "fp16 pools, GLM width 2051, 4 heads x 512": dict(batch=1, seq=20, heads=4, dim=512, sel="pools", topk_pools=512, dtype="float16", key_chunk=8),
    # Rows that do not ascend, walked unsorted: what the backward does until the answer to "do the
    # rows ascend?" (sparse_mla/row_order.py, read without a host sync) has come back. Same gradients, by the
    # kernel's absolute key addressing; the first query chunk is walked so, the later ones sorted.
    "fp32 random rows walked unsorted before their order is known, key chunks of 8, 3 query chunks":
        dict(batch=2, seq=40, heads=4, dim=32, sel="random", width=13, dtype="float32", key_chunk=8,
             query_chunks=3, fresh_order=True),
}
TOLERANCE = {"float32": 1e-5, "float16": 1e-2}

# The start of every interpreted script here (also tests/kernels/test_sparse_mla_replay.py).
INTERPRETER_PATCH = r"""
import numpy as np
import triton.runtime.interpreter as interp

# Triton 3.6's interpreter turns a scalar into an index with int() of a 1-element array, which
# numpy >= 2.4 refuses; the kernels' run-time loop bounds need it.
_patch = interp._patch_lang_tensor
def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
interp._patch_lang_tensor = _patched
"""

_INTERPRETED = INTERPRETER_PATCH + r"""
import json, os, sys
import torch

from genolong.kernels import _common
from genolong.kernels.sparse_mla import op as sparse_mla
from genolong.kernels.sparse_mla.row_order import RowOrder
from genolong.kernels.sparse_mla.triton_kernels import Config
from genolong.model.dsa import sparse_attention_reference
from genolong.model.indexer import indexer_topk_reference

_common.POISON = True
_pick = sparse_mla.pick
_tune_rows = sparse_mla.TUNE_ROWS
_key_chunk_rows = sparse_mla.key_chunk_rows
walks = []  # per query chunk: (walked unsorted, the rows ascend)

def watched_key_chunk_rows(idx, edges, order=None):
    walked, bounds = _key_chunk_rows(idx, edges, order)
    walks.append((walked is idx, _key_chunk_rows(idx, edges)[0] is idx))
    return walked, bounds

sparse_mla.key_chunk_rows = watched_key_chunk_rows

def pick_with_trials(kind, q, width, trial):
    # What pick() does on the GPU, minus the clock: every trial runs (twice), then "timed".
    config = sparse_mla.candidates(kind, q.shape[-2], q.shape[-1])[0]
    for _ in range(2):
        trial(config)
    return config, True

def selection(c, g):
    batch, seq, kv_len = c["batch"], c["seq"], c.get("kv_len", c["seq"])
    if c["sel"] in ("random", "ascending"):
        idx = torch.randint(-1, kv_len, (batch, seq, c["width"]), generator=g, dtype=torch.int32)
        idx[0, seq // 2] = -1
        if c["sel"] == "ascending":
            idx = torch.where(idx < 0, idx, idx.clamp(min=0).sort(dim=-1).values)  # -1 slots stay where they were
        return idx
    iq, keys, w = torch.randn(batch, seq, 2, 16, generator=g), torch.randn(batch, seq // 4, 16, generator=g), torch.rand(batch, seq, 2, generator=g)
    return indexer_topk_reference(iq, keys, w, kpool=4, topk_pools=c["topk_pools"], always_select_tail=True, softmax_scale=0.25)

def lse_reference(q, kv, idx, scale):
    rows = kv.gather(1, idx.clamp(min=0).long().flatten(1)[..., None].expand(-1, -1, kv.shape[-1])).view(*idx.shape, -1)
    s = torch.einsum("bthd,btwd->bthw", q, rows) * scale
    return s.masked_fill((idx < 0)[:, :, None], float("-inf")).logsumexp(-1)

def rel(a, b):
    a, b = a.double(), b.double()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()

for name, c in json.loads(sys.argv[1]).items():
    if c.get("fresh_order"):
        sparse_mla.ROW_ORDER = RowOrder()
    walks.clear()
    g = torch.Generator().manual_seed(len(name))
    dtype = getattr(torch, c["dtype"])
    kv_len, dim = c.get("kv_len", c["seq"]), c["dim"]
    q = torch.randn(c["batch"], c["seq"], c["heads"], dim, generator=g, dtype=torch.float64)
    kv = torch.randn(c["batch"], kv_len, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    idx = selection(c, g)
    scale = dim ** -0.5
    configs = {k: Config(*v) for k, v in c.get("configs", {}).items()}
    sparse_mla.pick = pick_with_trials if c.get("trials") else _pick
    # Trials on fewer rows than the call has, so a full pass that skipped a row would show.
    sparse_mla.TUNE_ROWS = 16 if c.get("trials") else _tune_rows
    width = idx.shape[-1]
    n_chunks = -(-kv_len // c.get("key_chunk", sparse_mla.KEY_CHUNK))
    budget = sparse_mla.backward_row_bytes(width, c["heads"], dim, n_chunks) * -(-c["batch"] * c["seq"] // c.get("query_chunks", 1))

    def run(fn, dt):
        a, b = q.to(dt).clone().requires_grad_(), kv.to(dt).clone().requires_grad_()
        out, lse = fn(a, b)
        out.backward(dout.to(dt))
        return out.detach(), lse, a.grad, b.grad

    ref = run(lambda a, b: (sparse_attention_reference(a, b, idx, scale=scale), lse_reference(a.detach(), b.detach(), idx, scale)), torch.float64)
    got = run(lambda a, b: sparse_mla.sparse_mla(a, b, idx, scale=scale, return_lse=True,
                                                  key_chunk=c.get("key_chunk", sparse_mla.KEY_CHUNK), budget_bytes=budget,
                                                  configs=configs), dtype)
    finite = torch.isfinite(ref[1])
    lse_err = (got[1][finite].double() - ref[1][finite]).abs().max().item() if finite.any() else 0.0
    print("RESULT", json.dumps(dict(name=name, out=rel(got[0], ref[0]), dq=rel(got[2], ref[2]), dkv=rel(got[3], ref[3]),
                                    lse=lse_err, lse_empty=bool((got[1][~finite] == float("-inf")).all()),
                                    empty_rows=int((~finite).sum()), out_dtype=str(got[0].dtype), lse_dtype=str(got[1].dtype),
                                    unsorted_not_ascending=sum(u and not a for u, a in walks),
                                    sorted_not_ascending=sum(not u and not a for u, a in walks))), flush=True)
"""


@pytest.fixture(scope="module")
def interpreted():
    # The key-chunked cases walk rows with the one-pass bounds (chunk_bounds_triton, run by the interpreter).
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED, json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=600)
    results = {r["name"]: r for r in (json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT "))}
    assert len(results) == len(CASES), run.stdout[-2000:] + run.stderr[-4000:]
    return results


@needs_triton
@pytest.mark.slow(seconds=70)  # one interpreter process for all cases
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernels_match_the_reference(interpreted, name):
    r, tol = interpreted[name], TOLERANCE[CASES[name]["dtype"]]
    assert r["out_dtype"] == f"torch.{CASES[name]['dtype']}" and r["lse_dtype"] == "torch.float32"
    for field in ("out", "dq", "dkv"):
        assert r[field] <= tol, (field, r)
    assert r["lse"] <= 10 * tol, r  # absolute, natural log
    assert r["lse_empty"], r  # rows with no valid slot: lse -inf
    if CASES[name].get("fresh_order"):
        # The first chunk went unsorted (the order not yet known), the rest sorted (it came back at once on the CPU).
        assert r["unsorted_not_ascending"] == 1 and r["sorted_not_ascending"] >= 1, r


def test_cases_cover_empty_rows_and_partial_blocks():
    # The random selections have an all -1 row; the pool selections' early queries have fewer keys than slots.
    assert any(c["sel"] == "random" for c in CASES.values()) and any(c.get("topk_pools") == 512 for c in CASES.values())
    assert any(c.get("kv_len", c["seq"]) > c["seq"] for c in CASES.values())


def test_declines_what_it_cannot_run():
    q, kv, idx = torch.zeros(1, 8, 4, 512), torch.zeros(1, 8, 512), torch.zeros(1, 8, 3, dtype=torch.int32)
    with pytest.raises(KernelUnsupported, match="CUDA"):
        sparse_mla.dsa_sparse_attention(q, kv, idx, scale=0.1)
    with pytest.raises(KernelUnsupported, match="latent width"):
        sparse_mla.check_supported(torch.zeros(1, 8, 4, 576), torch.zeros(1, 8, 576), idx)
    with pytest.raises(KernelUnsupported, match="indices must be torch.int32"):
        sparse_mla.check_supported(q, kv, idx.long())
    with pytest.raises(KernelUnsupported, match="kv must be torch.float32"):
        sparse_mla.check_supported(q, kv.half(), idx)
    with pytest.raises(KernelUnsupported, match="mismatch"):
        sparse_mla.check_supported(q, torch.zeros(2, 8, 512), idx)


def test_can_be_switched_off_for_the_tilelang_kernel(monkeypatch):
    monkeypatch.setenv(sparse_mla.ENV_SWITCH, "off")
    with pytest.raises(KernelUnsupported, match="GENOLONG_SPARSE_MLA=off"):
        sparse_mla.dsa_sparse_attention(torch.zeros(1, 8, 4, 512), torch.zeros(1, 8, 512), torch.zeros(1, 8, 3, dtype=torch.int32), scale=0.1)


def test_a_bad_switch_or_key_chunk_is_a_one_line_error(monkeypatch):
    args = (torch.zeros(1, 8, 4, 64), torch.zeros(1, 8, 64), torch.zeros(1, 8, 3, dtype=torch.int32))
    with pytest.raises(GenolongError, match="key_chunk must be a positive number of keys, got 0"):
        sparse_mla.sparse_mla(*args, scale=0.1, key_chunk=0)
    monkeypatch.setenv(sparse_mla.ENV_SWITCH, "no")
    with pytest.raises(GenolongError, match="GENOLONG_SPARSE_MLA='no' is not a setting; set it to one of on, off"):
        sparse_mla.dsa_sparse_attention(*args, scale=0.1)


def test_key_chunked_backward_memory_follows_the_budget():
    # 1M tokens, 4 heads, W = 2051: the sort, bounds and fp32 dq of one query chunk fit 1 GiB,
    # and a chunk is still tens of thousands of rows (few launches).
    n_chunks = (1 << 20) // sparse_mla.KEY_CHUNK
    rows = sparse_mla.backward_rows_per_chunk(2051, 4, 512, n_chunks, sparse_mla.QUERY_BUDGET_BYTES)
    per_row = 2051 * 20 + (n_chunks + 1) * 12 + 4 * 512 * 4
    assert rows * per_row <= sparse_mla.QUERY_BUDGET_BYTES and rows >= 20000


def test_candidates_fit_the_sm90_limits_chosen_offline():
    for heads in (4, 8, 16, 64):
        for kind in ("fwd", "bwd"):
            found = sparse_mla.candidates(kind, heads, 512)
            assert found and len(set(found)) == len(found)
            assert all(c.head_block <= (64 if kind == "fwd" else 32) and c.head_block >= min(16, heads) for c in found)
        assert len(sparse_mla.candidates("fwd", heads, 64)) == 1


# ----------------------------------------------------------------------------- sm_90 builds


@needs_triton
@pytest.mark.parametrize("heads", [4, 8, 16, 64])  # glm53-mini, GLM-5.3-Flash at TP 8 / 4, whole
def test_kernels_compile_for_sm90_without_spills(heads):
    # Every candidate the first call may time, built as the JIT specialises it (aligned pointers;
    # the lengths and head count are not specialised): tensor cores, asynchronous gathers, no
    # spills, and shared memory within what an H200 block may have.
    from genolong.kernels import aot
    from genolong.kernels.sparse_mla import triton_kernels as k

    builds = {}
    for kind in ("fwd", "bwd"):
        for config in sparse_mla.candidates(kind, heads, 512):
            builds[f"{kind} {config.label()}"] = k.aot_compile(kind, heads, 512, config)
            if kind == "bwd":
                builds[f"bwd ranged {config.label()}"] = k.aot_compile(kind, heads, 512, config, ranged=True)
    for name, kernel in builds.items():
        ptx = kernel.asm["ptx"]
        assert ("wgmma" if heads == 64 and name == "fwd HB64/BN32/w8/s5" else "mma.sync") in ptx, name  # tensor cores
        assert "cp.async" in ptx, name  # the gathered rows are copied asynchronously
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, (name, kernel.metadata.shared)
        regs, spills = aot.ptxas_usage(kernel)
        assert spills == 0, (name, regs, spills)
    # dkv: one vectorised relaxed atomic per 4 columns, after the sum over the head block.
    assert all("atom.global.gpu.relaxed.add.v4.f32" in kernel.asm["ptx"] for name, kernel in builds.items() if name.startswith("bwd"))


def _ranges(walked, bounds, edges):
    """{(row, chunk): sorted valid keys of the chunk's slot range}, checking each range's keys lie in the chunk."""
    found = {}
    for r in range(walked.shape[0]):
        for c in range(edges.numel() - 1):
            keys = walked[r, bounds[r, c] : bounds[r, c + 1]]
            keys = keys[keys >= 0]
            assert ((keys >= edges[c]) & (keys < edges[c + 1])).all(), (r, c, keys)
            found[(r, c)] = sorted(keys.tolist())
    return found


@pytest.mark.parametrize("ascending", [True, False])
def test_key_chunk_rows_cover_every_key_once_in_its_chunk(ascending):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50, (6, 19), generator=g, dtype=torch.int32)
    if ascending:
        idx = idx.sort(dim=-1).values
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1  # empty slots anywhere: first, inside, last
    idx[2] = -1
    edges = torch.arange(0, 57, 8, dtype=torch.int32)  # 7 chunks of 8 keys: the last ends past every key
    walked, bounds = sparse_mla.key_chunk_rows(idx, edges)
    assert (walked is idx) == ascending  # ascending rows are walked as they are, no sort
    assert bounds.dtype == torch.int32 and bounds.shape == (6, 8)
    found = _ranges(walked, bounds, edges)
    for r in range(6):
        valid = idx[r][idx[r] >= 0].tolist()
        assert sorted(k for c in range(7) for k in found[(r, c)]) == sorted(valid)  # each key in exactly one range


def test_key_chunk_rows_sort_when_one_row_does_not_ascend():
    idx = torch.tensor([[0, -1, 3, 9], [5, 2, -1, 7]], dtype=torch.int32)
    edges = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    walked, bounds = sparse_mla.key_chunk_rows(idx, edges)
    assert walked.tolist() == [[-1, 0, 3, 9], [-1, 2, 5, 7]]
    assert bounds.tolist() == [[1, 3, 3, 4], [1, 2, 4, 4]]  # chunks [0, 4), [4, 8), [8, 12)


def test_key_chunk_rows_with_an_order_walk_by_the_latest_answer_and_send_their_own():
    from genolong.kernels.sparse_mla.row_order import RowOrder

    idx = torch.tensor([[0, -1, 3, 9], [5, 2, -1, 7]], dtype=torch.int32)  # row 1 does not ascend
    edges = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    order = RowOrder()  # nothing known yet: ascending assumed, no sync
    walked, bounds = sparse_mla.key_chunk_rows(idx, edges, order=order)
    assert walked is idx and not order.ascend  # walked as it is; this chunk's answer has arrived
    # Every valid slot in exactly one chunk's range (what the kernel's gradients need), even where a
    # range holds a key of a later chunk (row 1: its 5 sits before its 2).
    for r in range(2):
        covered = [s for c in range(3) for s in range(bounds[r, c], bounds[r, c + 1]) if idx[r, s] >= 0]
        assert sorted(covered) == [s for s in range(4) if idx[r, s] >= 0], (r, bounds[r])
    assert bounds[1].tolist() == [0, 2, 4, 4]  # suffix minima 2, 2, 7, 7: slots 0-1 (keys 5, 2) in chunk 0
    walked, bounds = sparse_mla.key_chunk_rows(idx, edges, order=order)  # now known: sorted
    assert walked.tolist() == [[-1, 0, 3, 9], [-1, 2, 5, 7]] and bounds.tolist() == [[1, 3, 3, 4], [1, 2, 4, 4]]
    walked, _ = sparse_mla.key_chunk_rows(idx[:1], edges, order=order)  # ascending rows: sorted once more, then not
    assert walked is not idx and order.ascend
    assert sparse_mla.key_chunk_rows(idx[:1], edges, order=order)[0].data_ptr() == idx.data_ptr()


@needs_triton
def test_the_backward_packs_only_where_half_the_head_block_is_free():
    from genolong.kernels.sparse_mla.triton_kernels import Config, packs

    assert packs(4, Config(16, 16, 4, 5)) and packs(8, Config(16, 16, 4, 5)) and packs(16, Config(32, 16, 8, 5))
    assert not packs(9, Config(16, 16, 4, 5)) and not packs(16, Config(16, 16, 4, 5))


