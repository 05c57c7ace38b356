"""DSA sparse attention on genolong's few-head Triton sparse-MLA kernels (sparse_mla/triton_kernels.py).

Built for what every GPU of a GLM-5.3 run executes: 4 heads (glm53-mini), 8 / 16 (GLM-5.3-Flash
at tensor parallelism 8 / 4), 64 (whole). Unlike megatron-core's TileLang kernel it needs no
padded copies (512-wide latent as is, any width W, heads padded in registers only), reads each
selected latent row once per query for all its heads, and adds dkv once per (slot, column) after
summing over the heads. docs/kernels.md has the design and the bytes-per-query analysis.

dkv: each query's row is put in key order (sorted, unless its keys already ascend, as the fused
indexer writes them; which of the two is learned without a host sync, sparse_mla/row_order.py), and the pass
runs key chunk by key chunk (programs ordered chunk-major), so the kv rows and fp32 dkv rows in use
fit in L2; dq becomes a partial sum per chunk, added into an fp32 buffer. Rows are processed in
query chunks sized from a byte budget (the sort, the chunk ranges and the fp32 dq of a chunk). With
one key chunk (S <= key_chunk) it is one query-major pass with dq in registers.

The forward: one program per query (all its heads, all its slots; the gathers come from DRAM).

Launch configurations are timed on first use per (kernel, heads, width, dtype) on the GPU (a
few candidates, on the last 16k rows of the call: the fullest selections, the most key chunks)
and remembered; `chosen_configs()` lists them.
"""

from __future__ import annotations

import math
import os
import statistics

import torch

from genolong import switches
from genolong.errors import GenolongError
from genolong.kernels import _common
from genolong.kernels.sparse_mla.reference import ascending_bounds_reference, searched_bounds
from genolong.kernels.sparse_mla.row_order import RowOrder
from genolong.model.ops import KernelUnsupported

ENV_SWITCH = "GENOLONG_SPARSE_MLA"
# Keys per chunk of the key-chunked backward: 16 MiB of bf16 kv + 32 MiB of fp32 dkv, about an H200's
# L2. Measured (bench_sparse_attention.py probes, 2026-12-02): 512k x 4 heads 1,213 ms vs 1,341 at
# 8192 and 1,582 at 4096; 128k 276.7 vs 275.5 at 8192, 296 at 32768.
KEY_CHUNK = 16384
# What the backward has learned of its rows' order (sparse_mla/row_order.py): one per process, since one
# model's DSA layers share one selection kernel.
ROW_ORDER = RowOrder()
QUERY_BUDGET_BYTES = 1 << 30
TUNE_ROWS = 16384
ROW_ALIGN = 16
DIMS = (16, 32, 64, 128, 256, 512)


def check_supported(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> None:
    if q.ndim != 4 or kv.ndim != 3 or indices.ndim != 3:
        raise KernelUnsupported(f"expects q [B,T,H,D], kv [B,S,D], indices [B,T,W]; got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    if q.shape[:2] != indices.shape[:2] or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise KernelUnsupported(f"batch/length/width mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    if q.shape[-1] not in DIMS:
        raise KernelUnsupported(f"latent width must be one of {DIMS}, got {q.shape[-1]}")
    _common.require_dtype("q", q, torch.bfloat16, torch.float16, torch.float32)
    _common.require_dtype("kv", kv, q.dtype)
    _common.require_dtype("indices", indices, torch.int32)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ----------------------------------------------------------------------------- launch configs


def candidates(kind: str, heads: int, dim: int) -> list:
    """The configurations timed for a kernel ("fwd", "bwd" one pass, "bwd_keychunk"); the first is
    the default (used untimed on the CPU and below 512 columns). Chosen from the sm_90 builds
    (ptxas, no spills, shared memory within 227 KiB, docs/kernels.md): the gathered keys are
    double-buffered only from 5 pipeline stages on (the index load is a stage of its own); a
    backward program with 64 heads needs more than 227 KiB, so the backward takes at most 32
    heads per program."""
    from genolong.kernels.sparse_mla.triton_kernels import Config, head_block

    hb = head_block(heads)
    if kind.startswith("fwd"):
        found = [Config(16, 32, 8, 5), Config(16, 64, 8, 5), Config(16, 64, 8, 4)] if hb == 16 else [Config(hb, 32, 8, 5), Config(32, 32, 8, 5)]
    else:
        # 4 warps: two programs per SM (236 registers), for the key-chunked pass's short programs.
        found = [Config(16, 16, 8, 5), Config(16, 16, 4, 5), Config(16, 32, 8, 5)] if hb == 16 else [Config(32, 16, 8, 5)]
    found = list(dict.fromkeys(found))
    return found[:1] if dim < 512 else found


_CHOSEN: dict[tuple, object] = {}


def chosen_configs() -> dict[str, str]:
    """{"kernel heads=H D=.. dtype": config label} for every configuration picked so far."""
    return {f"{k[0]} heads={k[1]} D={k[2]} W={k[3]} {k[4]}": c.label() for k, c in _CHOSEN.items()}


def _time_ms(run, reps: int = 3) -> float:
    run()  # compiles, then warms
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def pick(kind: str, q: torch.Tensor, width: int, trial) -> tuple[object, bool]:
    """(config, timed): the remembered or default config, or the fastest candidate by `trial(config)`."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    heads, dim = q.shape[-2], q.shape[-1]
    key = (kind, heads, dim, width, str(q.dtype).removeprefix("torch."))
    if key in _CHOSEN:
        return _CHOSEN[key], False
    options = candidates(kind, heads, dim)
    if len(options) == 1 or not q.is_cuda:
        _CHOSEN[key] = options[0]
        return options[0], False
    timed, reasons = {}, []
    for config in options:
        try:
            timed[config] = _time_ms(lambda: trial(config))
        except (OutOfResources, PTXASError, CompileTimeAssertionFailure) as why:
            reasons.append(f"{config.label()}: {type(why).__name__}")
    if not timed:
        raise KernelUnsupported(f"no {kind} configuration compiles for {heads} heads x {dim}: {'; '.join(reasons)}")
    _CHOSEN[key] = min(timed, key=timed.get)
    return _CHOSEN[key], True


# ----------------------------------------------------------------------------- forward / backward


def _aligned(rows: int) -> int:
    # Row offsets of the launches' views stay multiples of 16 rows, so every view is 16-byte
    # aligned and no launch needs a build specialised for an unaligned pointer.
    return rows // ROW_ALIGN * ROW_ALIGN


def _forward(q, kv, idx, scale, config=None):
    from genolong.kernels.sparse_mla import triton_kernels as k

    batch, seq, heads, dim = q.shape
    rows = q.view(-1, heads, dim)
    flat_idx = idx.view(batch * seq, idx.shape[-1])
    out = _common.empty(rows.shape, dtype=q.dtype, device=q.device)
    lse = _common.empty(rows.shape[:2], dtype=torch.float32, device=q.device)
    kw = dict(seq_q=seq, seq_kv=kv.shape[1], scale=scale)
    kv_rows = kv.view(-1, dim)
    if config is None:
        # Trials run on the last rows (the fullest selections); the full launch below overwrites them.
        r0 = _aligned(max(0, rows.shape[0] - TUNE_ROWS))
        config, _ = pick("fwd", q, flat_idx.shape[1],
                         lambda c: k.forward(rows[r0:], kv_rows, flat_idx[r0:], out[r0:], lse[r0:], row0=r0, config=c, **kw))
    k.forward(rows, kv_rows, flat_idx, out, lse, row0=0, config=config, **kw)
    return out.view(q.shape), lse.view(batch, seq, heads)


def backward_row_bytes(width: int, heads: int, dim: int, n_chunks: int) -> int:
    """Transient bytes per query row of a key-chunked launch: the ascending check (an int32 copy, its
    flip, cummin's int32 values and int64 positions; a sort needs less), the chunk bounds (and
    searchsorted's input) and the fp32 dq partial sums."""
    return width * 20 + (n_chunks + 1) * 12 + heads * dim * 4


def key_chunk_rows(idx: torch.Tensor, edges: torch.Tensor, order: RowOrder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows the key-chunked pass walks, bounds [n, C + 1] int32): row r's slots of key chunk c are
    [bounds[r, c], bounds[r, c + 1]) of its walked row; every valid slot lies in exactly one range.

    Rows whose keys ascend apart from their empty (negative) slots are walked as they are: the fused
    indexer writes its pools in ascending order, then the tail, so this skips a sort of every row.
    Their bounds are `ascending_bounds_reference`'s (on CUDA, and in Triton's interpreter, its
    one-pass kernel sparse_mla/chunk_bounds.py). Otherwise the rows are sorted (empty slots first).

    Without `order`: one host sync decides, and a range's keys always lie in its chunk. With the
    backward's `order` (sparse_mla/row_order.py): no sync; the rows are walked as they are while the latest
    answer that has arrived says they ascend, and this chunk's answer is sent on. Rows that do not
    ascend, walked so, give the same gradients (the kernel addresses keys absolutely), only slower."""
    if (idx.is_cuda or _interpreted()) and idx.dtype == torch.int32:
        from genolong.kernels.sparse_mla import chunk_bounds as chunk_bounds_triton

        ranges, ascends = chunk_bounds_triton.ascending_bounds(idx.contiguous(), edges.contiguous())
    else:
        ranges, ascends = ascending_bounds_reference(idx, edges)
    if order is not None:
        walk_as_is = order.latest()
        order.send(ascends)
    else:
        walk_as_is = bool(ascends)
    if walk_as_is:
        return idx, ranges
    ranges = None  # freed before the sort
    walked = torch.sort(idx, dim=-1).values
    return walked, searched_bounds(walked, edges)


def backward_rows_per_chunk(width: int, heads: int, dim: int, n_chunks: int, budget_bytes: int) -> int:
    return max(1, budget_bytes // backward_row_bytes(width, heads, dim, n_chunks))


def _backward(q, kv, idx, out, lse, dout, scale, key_chunk, budget_bytes, config=None):
    """dq and dkv: one query-major pass when the keys are one chunk, else key chunk by key chunk."""
    from genolong.kernels.sparse_mla import triton_kernels as k

    batch, seq, heads, dim = q.shape
    seq_kv = kv.shape[1]
    n_rows = batch * seq
    rows, drows = q.view(n_rows, heads, dim), dout.view(n_rows, heads, dim)
    flat_idx, flat_lse = idx.view(n_rows, idx.shape[-1]), lse.view(n_rows, heads)
    width = flat_idx.shape[1]
    kv_rows = kv.view(-1, dim)
    dlt = _common.empty((n_rows, heads), dtype=torch.float32, device=q.device)
    k.delta(out.view(n_rows, heads, dim), drows, dlt)
    dkv = torch.zeros((batch * seq_kv, dim), dtype=torch.float32, device=q.device)
    dq = _common.empty(rows.shape, dtype=q.dtype, device=q.device)
    kw = dict(seq_q=seq, seq_kv=seq_kv, scale=scale)
    n_chunks = max(1, math.ceil(seq_kv / key_chunk))

    def launch(r0, r1, config, dq_dst, bounds=None, sorted_idx=None):
        src = flat_idx[r0:r1] if sorted_idx is None else sorted_idx
        k.backward(rows[r0:r1], kv_rows, src, drows[r0:r1], flat_lse[r0:r1], dlt[r0:r1], dq_dst, dkv,
                   row0=r0, config=config, bounds=bounds, **kw)

    if n_chunks == 1:
        if config is None:
            r0 = _aligned(max(0, n_rows - TUNE_ROWS))
            config, timed = pick("bwd", q, width, lambda c: launch(r0, n_rows, c, dq[r0:]))
            if timed:
                dkv.zero_()  # the trials added into it
        launch(0, n_rows, config, dq)
        return dq.view(q.shape), dkv.to(kv.dtype).view(kv.shape)

    step = max(ROW_ALIGN, _aligned(backward_rows_per_chunk(width, heads, dim, n_chunks, budget_bytes)))
    edges = torch.arange(n_chunks + 1, device=q.device, dtype=torch.int32) * key_chunk

    def chunk(r0, r1):
        """The rows in key order (key_chunk_rows), each key chunk's slot range, a zero dq."""
        walked, bounds = key_chunk_rows(flat_idx[r0:r1], edges, ROW_ORDER)
        return walked, bounds, torch.zeros((r1 - r0, heads, dim), dtype=torch.float32, device=q.device)

    if config is None:
        # Trials on the last rows (the most key chunks per row), before anything is added to dkv;
        # their rows are ordered only if a trial runs (a remembered config needs none).
        r0 = _aligned(max(0, n_rows - min(step, TUNE_ROWS)))
        trial_rows = []

        def trial(c):
            if not trial_rows:
                trial_rows.extend(chunk(r0, n_rows))
            walked, bounds, dq32 = trial_rows
            launch(r0, n_rows, c, dq32, bounds, walked)

        config, timed = pick("bwd_keychunk", q, width, trial)
        if timed:
            dkv.zero_()
        trial_rows.clear()
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        sorted_idx, bounds, dq32 = chunk(r0, r1)
        launch(r0, r1, config, dq32, bounds, sorted_idx)
        dq[r0:r1] = dq32
    return dq.view(q.shape), dkv.to(kv.dtype).view(kv.shape)


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale, key_chunk, budget_bytes, configs, kept=None):
        if kept is None:
            out, lse = _forward(q, kv, indices, scale, configs.get("fwd"))
        else:
            # A recompute replaying its forward's result (genolong.train.keep): nothing to attend.
            # Fresh aliases, so autograd's history goes on them and not on the kept tensors.
            out, lse = kept[0].view_as(kept[0]), kept[1].view_as(kept[1])
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.key_chunk, ctx.budget_bytes, ctx.configs = scale, key_chunk, budget_bytes, configs
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients are not differentiable again
    def backward(ctx, dout, _dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        dq, dkv = _backward(q, kv, indices, out, lse, dout.contiguous().to(q.dtype), ctx.scale,
                            ctx.key_chunk, ctx.budget_bytes, ctx.configs.get("bwd"))
        return dq, dkv, None, None, None, None, None, None


def sparse_mla(q, kv, indices, *, scale: float, return_lse: bool = False, key_chunk: int = KEY_CHUNK,
               budget_bytes: int = QUERY_BUDGET_BYTES, configs: dict | None = None):
    """The op on the Triton kernels, on CUDA or (TRITON_INTERPRET=1) the CPU; `configs` may pin
    {"fwd": Config, "bwd": Config} instead of timing candidates. `key_chunk`: keys per chunk of the
    backward (one query-major pass when the keys fit one chunk). The launch config chosen for a
    kernel is remembered per (kernel, heads, width, dtype), not per key chunk."""
    if key_chunk < 1:
        raise GenolongError(f"key_chunk must be a positive number of keys, got {key_chunk}")
    check_supported(q, kv, indices)
    if not (q.is_cuda or _interpreted()):
        raise KernelUnsupported(f"needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1), got {q.device}")
    out, lse = _SparseMLA.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), float(scale),
                                int(key_chunk), int(budget_bytes), dict(configs or {}))
    return (out, lse) if return_lse else out


def replay_dsa_sparse_attention(kept, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float,
                                return_lse: bool = False):
    """The op's result from the (out, lse) its forward kept (genolong.train.keep), with this kernel's
    backward: a recompute that does not attend again. Reference: genolong.model.sparse_replay."""
    out, lse = kept
    if out.shape != q.shape or lse.shape != q.shape[:3]:
        raise GenolongError(f"kept sparse-attention result {tuple(out.shape)} / {tuple(lse.shape)} does not match q {tuple(q.shape)}")
    out, lse = _SparseMLA.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), float(scale), KEY_CHUNK,
                                QUERY_BUDGET_BYTES, {}, (out.contiguous(), lse.contiguous()))
    return (out, lse) if return_lse else out


def dsa_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, return_lse: bool = False):
    """The "dsa_sparse_attention" op (docs/ops.md) on the few-head Triton sparse-MLA kernels.

    GENOLONG_SPARSE_MLA=off (genolong.switches) declines: the next implementation, megatron-core's
    TileLang kernel, runs instead."""
    if switches.get(ENV_SWITCH) == "off":
        raise KernelUnsupported(f"disabled by {ENV_SWITCH}=off")
    _common.require_cuda(q, kv, indices)
    check_supported(q, kv, indices)
    if not math.isfinite(scale):
        raise KernelUnsupported(f"scale must be finite, got {scale}")
    try:
        import genolong.kernels.sparse_mla.triton_kernels  # noqa: F401
    except ImportError as why:
        raise KernelUnsupported(f"triton is not importable: {why}") from why
    return sparse_mla(q, kv, indices, scale=scale, return_lse=return_lse)
