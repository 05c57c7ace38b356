"""DSA sparse attention on genolong's few-head Triton sparse-MLA kernels (sparse_mla_triton.py).

Built for what every GPU of a GLM-5.3 run executes: 4 heads (glm53-mini), 8 / 16 (GLM-5.3-Flash
at tensor parallelism 8 / 4), 64 (whole). Unlike megatron-core's TileLang kernel it needs no
padded copies (512-wide latent as is, any width W, heads padded in registers only), reads each
selected latent row once per query for all its heads, and adds dkv once per (slot, column) after
summing over the heads. docs/kernels.md has the design and the bytes-per-query analysis.

dkv, two ways (`dkv_mode`):
- "atomic": one query-major pass; the fp32 dkv buffer ([S, 512], 4x the size of L2 at 128k) is
  added to at random rows.
- "keychunk": each query's row is put in key order (sorted, unless its keys already ascend, as the
  fused indexer writes them; which of the two is learned without a host sync, row_order.py), and
  the same pass runs key chunk by key chunk (programs ordered chunk-major), so the kv rows and
  fp32 dkv rows in use fit in L2; dq becomes a partial sum per chunk, added into an fp32 buffer.
  Rows are processed in query chunks sized from a byte budget (the sort, the chunk ranges and the
  fp32 dq of a chunk). With one key chunk (S <= key_chunk) it is the atomic pass.

- "grouped" (sparse_mla_grouped.py): one launch per key chunk, in key order, programs owning
  groups of consecutive queries stacked into the tensor-core rows; dq in an fp32 buffer between
  launches.

The forward, three ways (`fwd_mode`): "query" (one program per query, all its slots: the gathers
come from DRAM), "keychunk" (the rows as the key-chunked backward walks them, key_chunk_rows,
one launch per key chunk of `fwd_key_chunk` keys, one query a program: the gathers of a launch
come from the chunk in L2; the online-softmax state in fp32 buffers between launches; no
packing or sort) or "grouped" (as the grouped backward: consecutive queries stacked, their
selections packed and sorted together). `fwd_key_chunk` is twice the backward's by default: no
dkv shares the L2. On the H200 both chunked forwards are slower than "query" (2026-12-03: 107 and
110 vs 88 ms at 128k x 4 heads; docs/kernels.md says why), so "query" is the default.

Launch configurations are timed on first use per (kernel, heads, width, dtype) on the GPU (a
few candidates, on the last 16k rows of the call: the fullest selections, the most key chunks)
and remembered; `chosen_configs()` lists them.
"""

from __future__ import annotations

import math
import os
import statistics

import torch

from genolong.errors import GenolongError, env_choice
from genolong.kernels import _common
from genolong.kernels.row_order import RowOrder
from genolong.model.ops import KernelUnsupported

ENV_SWITCH = "GENOLONG_SPARSE_MLA"
ENV_DKV_MODE = "GENOLONG_SPARSE_MLA_DKV"
ENV_FWD_MODE = "GENOLONG_SPARSE_MLA_FWD"
# "sync": ask the GPU each query chunk whether its rows ascend (one host sync each: the old path)
# instead of walking by the latest answer that has come back (row_order.py)
ENV_ORDER = "GENOLONG_SPARSE_MLA_ORDER"
# "torch": the key-chunked backward's row bounds by seven PyTorch passes instead of one Triton pass (the default)
ENV_BOUNDS = "GENOLONG_SPARSE_MLA_BOUNDS"
ENV_SORT = "GENOLONG_SPARSE_MLA_SORT"  # "always": sort every row for the key-chunked pass (the old path)
# "off": v1's backward keeps q and dO apart (5 products a slot block) even where it could stack them
# into one operand (3 products: sparse_mla_triton._sparse_mla_bwd_row_packed); "on" (default): stack.
ENV_PACK = "GENOLONG_SPARSE_MLA_PACK"
# "coalesced" (default): the backward's fp32 adds of dkv and dq's partial sums by tl.atomic_add, which
# first moves each block through shared memory into a coalesced layout; "layout": added from the
# products' own register layout, two columns an instruction (sparse_mla_triton._red_add_pairs; GPU only;
# H100, 2026-12-05: the 4-head backward 31% slower at 128k, 22% at 512k).
ENV_RED = "GENOLONG_SPARSE_MLA_ADDS"
# "off" (default): the timed launch configs are `candidates`' own; "candidates": v1's forward and
# backward also time the split score products (`split_candidates`; nineteenth session; H100,
# 2026-12-05: slower than the default configs at 4, 16 and 64 heads), so a step can try them without pinning.
ENV_SPLIT = "GENOLONG_SPARSE_MLA_SPLIT"
_DEFAULTS = {ENV_PACK: "on", ENV_RED: "coalesced", ENV_SPLIT: "off"}
DKV_MODES = ("atomic", "keychunk", "grouped")
FWD_MODES = ("query", "keychunk", "grouped")
DEFAULT_DKV_MODE = "keychunk"
DEFAULT_FWD_MODE = "query"
# Keys per chunk of the key-chunked backward: 16 MiB of bf16 kv + 32 MiB of fp32 dkv, about an H200's
# L2. Measured (bench_sparse_attention.py probes, 2026-12-02): 512k x 4 heads 1,213 ms vs 1,341 at
# 8192 and 1,582 at 4096; 128k 276.7 vs 275.5 at 8192, 296 at 32768. GENOLONG_SPARSE_MLA_KEY_CHUNK overrides it.
KEY_CHUNK = 16384
# What the backward has learned of its rows' order (row_order.py): one per process, since one
# model's DSA layers share one selection kernel.
ROW_ORDER = RowOrder()
ENV_KEY_CHUNK = "GENOLONG_SPARSE_MLA_KEY_CHUNK"
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
    """The configurations timed for a kernel ("fwd", "bwd", "fwd_grouped", "bwd_grouped"); the
    first is the default (used untimed on the CPU and below 512 columns). Chosen from the sm_90
    builds (ptxas, no spills, shared memory within 227 KiB, docs/kernels.md): the gathered keys are
    double-buffered only from 5 pipeline stages on (the index load is a stage of its own); a
    backward program with 64 heads needs more than 227 KiB, so the backward takes at most 32
    heads per program. The grouped kernels stack 16 // heads queries (up to 16 heads) so that
    a program has 16 rows, as v1's padded head block, and take 32 heads per program beyond."""
    from genolong.kernels.sparse_mla_triton import Config, head_block

    hb = head_block(heads)
    if kind.endswith("_grouped"):
        found = _grouped_candidates(kind, heads)
    elif kind == "fwd_keychunk":
        # The grouped forward kernel with one query a program; beyond 16 heads 32-head blocks (a
        # 64-head program holding the fp32 state spills, as the grouped forward's does).
        found = [Config(16, 32, 8, 5), Config(16, 64, 8, 5), Config(16, 32, 4, 5)] if hb == 16 else [Config(32, 32, 8, 5), Config(32, 64, 8, 5)]
    elif kind.startswith("fwd"):
        found = [Config(16, 32, 8, 5), Config(16, 64, 8, 5), Config(16, 64, 8, 4)] if hb == 16 else [Config(hb, 32, 8, 5), Config(32, 32, 8, 5)]
    else:
        # 4 warps: two programs per SM (236 registers), for the key-chunked pass's short programs.
        found = [Config(16, 16, 8, 5), Config(16, 16, 4, 5), Config(16, 32, 8, 5)] if hb == 16 else [Config(32, 16, 8, 5)]
    if kind in ("fwd", "bwd", "bwd_keychunk") and _split_setting() == "candidates":
        found += split_candidates("bwd" if kind.startswith("bwd") else kind, heads)
    found = list(dict.fromkeys(found))
    return found[:1] if dim < 512 else found


def split_candidates(kind: str, heads: int) -> list:
    """v1's launch configs with the score products split over the latent columns (Config.split_k),
    timed beside `candidates` under GENOLONG_SPARSE_MLA_SPLIT=candidates. From the sm_90 builds
    (read with a SASS census, 2026-12-04: no spills with either kind of adds): 16-row blocks up to 16 heads,
    32 beyond; the 16-head (unpacked) backward needs 8 warps to stay within the registers."""
    from genolong.kernels.sparse_mla_triton import Config, head_block

    if head_block(heads) > 16:
        return [Config(32, 16, 8, 5, split_k=8)]
    if kind == "fwd":
        return [Config(16, 32, 8, 5, split_k=8), Config(16, 32, 4, 5, split_k=4)]
    four_warps = [Config(16, 16, 4, 5, split_k=4)] if 2 * heads <= 16 else []
    return [*four_warps, Config(16, 16, 8, 5, split_k=8)]


def _grouped_candidates(kind: str, heads: int) -> list:
    from genolong.kernels.sparse_mla_triton import Config

    if heads > 16:
        # One query, 32-head blocks: a 64-head forward program holding the fp32 state spills, and
        # so does a 32-head backward program with 32 slots per step.
        return [Config(32, 32, 8, 5), Config(32, 64, 8, 5)] if kind == "fwd_grouped" else [Config(32, 16, 8, 5)]
    hb = min(16, 1 << max(0, heads - 1).bit_length())
    qg = 16 // hb  # 16 rows, as v1's padded head block
    if kind == "fwd_grouped":
        # 8 warps: <= 128 registers, two programs per SM; 4 warps: ~210, two per SM.
        return [Config(hb, 32, 8, 5, qg), Config(hb, 32, 4, 5, qg), Config(hb, 64, 8, 5, qg)]
    # 4 warps: <= 255 registers, two programs per SM (at 1-2 heads, 8-16 queries a program, it spills).
    four_warps = [Config(hb, 16, 4, 5, qg)] if hb >= 4 else []
    return [Config(hb, 16, 8, 5, qg), *four_warps, Config(hb, 32, 8, 5, qg)]


_CHOSEN: dict[tuple, object] = {}


def chosen_configs() -> dict[str, str]:
    """{"kernel heads=H D=.. dtype": config label} for every configuration picked so far."""
    return {f"{k[0]} heads={k[1]} D={k[2]} W={k[3]} {k[4]}" + (f" {k[5]}" if k[5] else ""): c.label() for k, c in _CHOSEN.items()}


def _settings_tag() -> str:
    """The environment settings that change the candidates or the kernels timed, where not the
    defaults: a choice made under one is not reused under another (a benchmark's arms switch them
    within one process)."""
    current = {ENV_SPLIT: _split_setting(), ENV_RED: _adds_setting(), ENV_PACK: _pack_setting()}
    return " ".join(f"{name}={value}" for name, value in current.items() if value != _DEFAULTS[name])


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
    key = (kind, heads, dim, width, str(q.dtype).removeprefix("torch."), _settings_tag())
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


def _forward(q, kv, idx, scale, mode="query", key_chunk=2 * KEY_CHUNK, budget_bytes=QUERY_BUDGET_BYTES, config=None):
    from genolong.kernels import sparse_mla_triton as k

    if mode == "grouped":
        return _forward_grouped(q, kv, idx, scale, key_chunk, budget_bytes, config)
    if mode == "keychunk" and kv.shape[1] > key_chunk:
        return _forward_keychunk(q, kv, idx, scale, key_chunk, budget_bytes, config)
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


def _query_chunks(batch: int, seq: int, step: int, last: int | None = None):
    """(batch element, first row, last row) of the query chunks of [B*T] rows: `step` rows at a
    time within each batch element; with `last`, only one chunk: the last `last` rows."""
    if last is not None:
        r0 = batch * seq - min(batch * seq, last)
        b = r0 // seq
        return [(b, r0, min(batch * seq, (b + 1) * seq))]
    return [(b, r0, min((b + 1) * seq, r0 + step)) for b in range(batch) for r0 in range(b * seq, (b + 1) * seq, step)]


def _forward_grouped(q, kv, idx, scale, key_chunk, budget_bytes, config):
    from genolong.kernels import sparse_mla_grouped as grouped

    batch, seq, heads, dim = q.shape
    n_rows, width = batch * seq, idx.shape[-1]
    rows, flat_idx = q.view(n_rows, heads, dim), idx.view(n_rows, width)
    out = _common.empty(rows.shape, dtype=q.dtype, device=q.device)
    lse = _common.empty(rows.shape[:2], dtype=torch.float32, device=q.device)

    def run(chunks, c):
        for b, r0, r1 in chunks:
            grouped.forward(rows[r0:r1], kv[b], flat_idx[r0:r1], out[r0:r1], lse[r0:r1], scale=scale, key_chunk=key_chunk, config=c)

    if config is None:
        # Trials on the last rows (the fullest selections); the passes below overwrite them.
        trial_rows = _query_chunks(batch, seq, 0, last=TUNE_ROWS)
        config, _ = pick("fwd_grouped", q, width, lambda c: run(trial_rows, c))
    n_chunks = max(1, math.ceil(kv.shape[1] / key_chunk))
    run(_query_chunks(batch, seq, grouped.rows_per_chunk(width, heads, dim, n_chunks, config.query_group, budget_bytes, ROW_ALIGN)),
        config)
    return out.view(q.shape), lse.view(batch, seq, heads)


def forward_row_bytes(width: int, heads: int, dim: int, n_chunks: int) -> int:
    """Transient bytes per query row of the key-chunked forward: the backward's (key_chunk_rows'
    transients; acc takes the place of the fp32 dq) and the online-softmax m and l."""
    return backward_row_bytes(width, heads, dim, n_chunks) + heads * 2 * 4


def _forward_keychunk(q, kv, idx, scale, key_chunk, budget_bytes, config):
    """out and lse, key chunk by key chunk: per query chunk, the rows as key_chunk_rows walks them
    (as they are where they ascend, which is learned without a host sync, else sorted) and each key
    chunk's slot ranges; then one launch per key chunk of the grouped forward kernel with one query
    a program, which continues the online softmax from the fp32 state the earlier chunks left. Every
    valid slot lies in exactly one range, so a row walked unsorted gets the same result."""
    from genolong.kernels import sparse_mla_grouped as grouped
    from genolong.kernels import sparse_mla_grouped_triton as k

    batch, seq, heads, dim = q.shape
    seq_kv = kv.shape[1]
    n_rows, width = batch * seq, idx.shape[-1]
    rows, flat_idx = q.view(n_rows, heads, dim), idx.view(n_rows, width)
    out = _common.empty(rows.shape, dtype=q.dtype, device=q.device)
    lse = _common.empty(rows.shape[:2], dtype=torch.float32, device=q.device)
    n_chunks = max(1, math.ceil(seq_kv / key_chunk))
    edges = torch.arange(n_chunks + 1, device=q.device, dtype=torch.int32) * key_chunk
    always_sort = _sort_setting() == "always"
    order = ROW_ORDER if _order_setting() == "async" else None

    def run(chunks, c):
        for b, r0, r1 in chunks:
            walked, bounds = key_chunk_rows(flat_idx[r0:r1], edges, always_sort, order)
            n = r1 - r0
            # A row's first chunk does not read acc (m = -inf there), so acc needs no zeros (poisoned
            # under test: a row read before it is written, or left unwritten, shows as NaN).
            acc = _common.empty((n, heads, dim), dtype=torch.float32, device=q.device)
            m = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device)
            l = torch.zeros((n, heads), dtype=torch.float32, device=q.device)
            # Launches of chunks a query chunk's rows do not reach end at once (no host sync to skip them).
            for chunk in range(n_chunks):
                k.forward_chunk(rows[r0:r1], kv[b], walked, bounds, acc, m, l, chunk=chunk, groups=(0, n), scale=scale, config=c)
            # l >= 1 wherever a key was seen (the maximum's own term) and 0 where none was (acc not written).
            seen = l > 0
            out[r0:r1] = acc.div_(l.clamp(min=1.0)[..., None]).masked_fill_(~seen[..., None], 0.0)
            lse[r0:r1] = torch.where(seen, (m + torch.log2(l.clamp(min=1.0))) * grouped.LN2, float("-inf"))

    step = max(ROW_ALIGN, _aligned(budget_bytes // forward_row_bytes(width, heads, dim, n_chunks)))
    if config is None:
        # Trials on the last rows (the most key chunks per row), no more than a query chunk's (the
        # budget holds for them too); the passes below overwrite them.
        config, _ = pick("fwd_keychunk", q, width, lambda c: run(_query_chunks(batch, seq, 0, last=min(step, TUNE_ROWS)), c))
    run(_query_chunks(batch, seq, step), config)
    return out.view(q.shape), lse.view(batch, seq, heads)


def backward_row_bytes(width: int, heads: int, dim: int, n_chunks: int) -> int:
    """Transient bytes per query row of a key-chunked launch: the ascending check (an int32 copy, its
    flip, cummin's int32 values and int64 positions; a sort needs less), the chunk bounds (and
    searchsorted's input) and the fp32 dq partial sums."""
    return width * 20 + (n_chunks + 1) * 12 + heads * dim * 4


def key_chunk_rows(idx: torch.Tensor, edges: torch.Tensor, always_sort: bool = False,
                   order: RowOrder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows the key-chunked pass walks, bounds [n, C + 1] int32): row r's slots of key chunk c are
    [bounds[r, c], bounds[r, c + 1]) of its walked row; every valid slot lies in exactly one range.

    Rows whose keys ascend apart from their empty (negative) slots are walked as they are: the fused
    indexer writes its pools in ascending order, then the tail, so this skips a sort of every row.
    Their bounds come from each slot's smallest key at or after it, which ascends: an empty slot
    joins the range of the next key (the kernel skips it), trailing ones no range. Otherwise the
    rows are sorted (empty slots first), as before (always with `always_sort`: GENOLONG_SPARSE_MLA_SORT=always,
    the measurement's old arm).

    Without `order`: one host sync decides, and a range's keys always lie in its chunk. With the
    backward's `order` (row_order.py): no sync; the rows are walked as they are while the latest
    answer that has arrived says they ascend, and this chunk's answer is sent on. Rows that do not
    ascend, walked so, give the same gradients (the kernel addresses keys absolutely), only slower.
    With GENOLONG_SPARSE_MLA_BOUNDS=triton the check and the ranges are one Triton pass
    (chunk_bounds_triton.py, the same integers)."""
    def bounds(ascending):
        return torch.searchsorted(ascending, edges.expand(idx.shape[0], -1).contiguous(), out_int32=True)

    if not always_sort:
        if _bounds_setting() == "triton" and (idx.is_cuda or _interpreted()) and idx.dtype == torch.int32:
            from genolong.kernels import chunk_bounds_triton

            ranges, ascends = chunk_bounds_triton.ascending_bounds(idx.contiguous(), edges.contiguous())
        else:
            filled = torch.where(idx >= 0, idx, torch.iinfo(idx.dtype).max)
            suffix_min = filled.flip(-1).cummin(-1).values.flip(-1)
            del filled
            ascends = ((idx < 0) | (idx == suffix_min)).all()
            ranges = None  # searched on suffix_min below, only if the rows are walked as they are
        if order is not None:
            walk_as_is = order.latest()
            order.send(ascends)
        else:
            walk_as_is = bool(ascends)
        if walk_as_is:
            return idx, ranges if ranges is not None else bounds(suffix_min)
        ranges = suffix_min = None  # freed before the sort
    walked = torch.sort(idx, dim=-1).values
    return walked, bounds(walked)


def backward_rows_per_chunk(width: int, heads: int, dim: int, n_chunks: int, budget_bytes: int) -> int:
    return max(1, budget_bytes // backward_row_bytes(width, heads, dim, n_chunks))


def _backward(q, kv, idx, out, lse, dout, scale, mode, key_chunk, budget_bytes, config=None, dkv_op="add"):
    """dq and dkv; dkv_op "skip" (any mode) or "store" (not grouped) are the benchmark's probes of
    what the dkv adds cost: the dkv they return is wrong."""
    if dkv_op not in ("add", "skip", "store") or (dkv_op == "store" and mode == "grouped"):
        raise GenolongError(f"dkv_op {dkv_op!r} is not a probe of the {mode} backward")
    from genolong.kernels import sparse_mla_triton as k

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
    if mode == "grouped":
        _backward_grouped(q, kv, idx, dout, lse, dlt, dq, dkv.view(batch, seq_kv, dim), scale, key_chunk, budget_bytes,
                          config, dkv_op == "add")
        return dq.view(q.shape), dkv.to(kv.dtype).view(kv.shape)
    one_pass = mode == "atomic" or n_chunks == 1
    pack = None if _pack_setting() == "on" else False
    red = _adds_setting() == "layout"
    if red and q.is_cuda and torch.cuda.get_device_capability(q.device) < (9, 0):
        raise GenolongError(f"{ENV_RED}=layout needs an sm_90 GPU (its vector adds); this one is "
                            f"sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}: unset it")

    def launch(r0, r1, config, dq_dst, bounds=None, sorted_idx=None):
        src = flat_idx[r0:r1] if sorted_idx is None else sorted_idx
        k.backward(rows[r0:r1], kv_rows, src, drows[r0:r1], flat_lse[r0:r1], dlt[r0:r1], dq_dst, dkv,
                   row0=r0, config=config, bounds=bounds, dkv_op=dkv_op, pack=pack, red=red, **kw)

    if one_pass:
        if config is None:
            r0 = _aligned(max(0, n_rows - TUNE_ROWS))
            config, timed = pick("bwd", q, width, lambda c: launch(r0, n_rows, c, dq[r0:]))
            if timed:
                dkv.zero_()  # the trials added into it
        launch(0, n_rows, config, dq)
        return dq.view(q.shape), dkv.to(kv.dtype).view(kv.shape)

    step = max(ROW_ALIGN, _aligned(backward_rows_per_chunk(width, heads, dim, n_chunks, budget_bytes)))
    always_sort = _sort_setting() == "always"
    order = ROW_ORDER if _order_setting() == "async" else None
    edges = torch.arange(n_chunks + 1, device=q.device, dtype=torch.int32) * key_chunk

    def chunk(r0, r1):
        """The rows in key order (key_chunk_rows), each key chunk's slot range, a zero dq."""
        walked, bounds = key_chunk_rows(flat_idx[r0:r1], edges, always_sort, order)
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


def _backward_grouped(q, kv, idx, dout, lse, dlt, dq, dkv, scale, key_chunk, budget_bytes, config, add_dkv):
    from genolong.kernels import sparse_mla_grouped as grouped

    batch, seq, heads, dim = q.shape
    n_rows, width = batch * seq, idx.shape[-1]
    rows, drows, flat_idx, flat_lse = q.view(n_rows, heads, dim), dout.view(n_rows, heads, dim), idx.view(n_rows, width), lse.view(n_rows, heads)

    def run(chunks, c):
        for b, r0, r1 in chunks:
            grouped.backward(rows[r0:r1], kv[b], flat_idx[r0:r1], drows[r0:r1], flat_lse[r0:r1], dlt[r0:r1], dq[r0:r1], dkv[b],
                             scale=scale, key_chunk=key_chunk, config=c, add_dkv=add_dkv)

    if config is None:
        config, timed = pick("bwd_grouped", q, width, lambda c: run(_query_chunks(batch, seq, 0, last=TUNE_ROWS), c))
        if timed:
            dkv.zero_()  # the trials added into it
    n_chunks = max(1, math.ceil(kv.shape[1] / key_chunk))
    run(_query_chunks(batch, seq, grouped.rows_per_chunk(width, heads, dim, n_chunks, config.query_group, budget_bytes, ROW_ALIGN)),
        config)


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale, mode, key_chunk, budget_bytes, configs, fwd_mode, fwd_key_chunk, kept=None):
        if kept is None:
            out, lse = _forward(q, kv, indices, scale, fwd_mode, fwd_key_chunk, budget_bytes, configs.get("fwd"))
        else:
            # A recompute replaying its forward's result (genolong.train.keep): nothing to attend.
            # Fresh aliases, so autograd's history goes on them and not on the kept tensors.
            out, lse = kept[0].view_as(kept[0]), kept[1].view_as(kept[1])
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.mode, ctx.key_chunk, ctx.budget_bytes, ctx.configs = scale, mode, key_chunk, budget_bytes, configs
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients are not differentiable again
    def backward(ctx, dout, _dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        dq, dkv = _backward(q, kv, indices, out, lse, dout.contiguous().to(q.dtype), ctx.scale, ctx.mode,
                            ctx.key_chunk, ctx.budget_bytes, ctx.configs.get("bwd"))
        return dq, dkv, None, None, None, None, None, None, None, None, None


def sparse_mla(q, kv, indices, *, scale: float, return_lse: bool = False, dkv_mode: str = DEFAULT_DKV_MODE,
               fwd_mode: str = DEFAULT_FWD_MODE, key_chunk: int = KEY_CHUNK, fwd_key_chunk: int | None = None,
               budget_bytes: int = QUERY_BUDGET_BYTES, configs: dict | None = None):
    """The op on the Triton kernels, on CUDA or (TRITON_INTERPRET=1) the CPU; `configs` may pin
    {"fwd": Config, "bwd": Config} (of the kernels the modes run) instead of timing candidates.
    `fwd_key_chunk` (the key-chunked and grouped forwards) defaults to twice `key_chunk`. The launch
    config chosen for a kernel is remembered per (kernel, heads, width, dtype), not per key chunk."""
    if dkv_mode not in DKV_MODES:
        raise GenolongError(f"dkv_mode {dkv_mode!r} is unknown; use one of {', '.join(DKV_MODES)}")
    if fwd_mode not in FWD_MODES:
        raise GenolongError(f"fwd_mode {fwd_mode!r} is unknown; use one of {', '.join(FWD_MODES)}")
    fwd_key_chunk = 2 * key_chunk if fwd_key_chunk is None else fwd_key_chunk
    if min(key_chunk, fwd_key_chunk) < 1:
        raise GenolongError(f"key chunks must be a positive number of keys, got {key_chunk} and {fwd_key_chunk}")
    check_supported(q, kv, indices)
    if not (q.is_cuda or _interpreted()):
        raise KernelUnsupported(f"needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1), got {q.device}")
    out, lse = _SparseMLA.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), float(scale), dkv_mode,
                                int(key_chunk), int(budget_bytes), dict(configs or {}), fwd_mode, int(fwd_key_chunk))
    return (out, lse) if return_lse else out


def _pack_setting() -> str:
    value = os.environ.get(ENV_PACK, _DEFAULTS[ENV_PACK])
    if value not in ("on", "off"):
        raise GenolongError(f"{ENV_PACK}={value!r} is not a setting; set it to on (stack q and dO where the head block has room) or off, or unset it")
    return value


def _split_setting() -> str:
    return env_choice(ENV_SPLIT, _DEFAULTS[ENV_SPLIT], {"off": "the default launch configs", "candidates": "also time the split score products"})


def _adds_setting() -> str:
    return env_choice(ENV_RED, _DEFAULTS[ENV_RED], {"coalesced": "tl.atomic_add after a move through shared memory",
                                             "layout": "the backward's fp32 adds from the products' own layout, on the GPU"})


def _order_setting() -> str:
    value = os.environ.get(ENV_ORDER, "async")
    if value not in ("async", "sync"):
        raise GenolongError(f"{ENV_ORDER}={value!r} is not a setting; set it to async (no host sync for the rows' order) or sync, or unset it")
    return value


def _sort_setting() -> str:
    value = os.environ.get(ENV_SORT, "auto")
    if value not in ("auto", "always"):
        raise GenolongError(f"{ENV_SORT}={value!r} is not a setting; set it to auto (sort rows whose keys do not ascend) or always, or unset it")
    return value


def _bounds_setting() -> str:
    """How key_chunk_rows finds the ranges of rows walked as they are on CUDA: "triton" (default: one
    pass, chunk_bounds_triton.py) or "torch" (the seven PyTorch passes). With both one-pass kernels a
    128k step ran 6.25 s against 6.35 s, every step of the four faster (H200, 2026-12-03, eighteenth
    session; before the host syncs were gone the 142 ms of GPU time it saves did not show)."""
    setting = os.environ.get(ENV_BOUNDS, "triton")
    if setting not in ("triton", "torch"):
        raise GenolongError(f"{ENV_BOUNDS}={setting!r} is not triton or torch; unset it or set one of those")
    return setting


def _key_chunk() -> int:
    text = os.environ.get(ENV_KEY_CHUNK, str(KEY_CHUNK))
    if not text.isdigit() or int(text) < 1:
        raise GenolongError(f"{ENV_KEY_CHUNK}={text!r} is not a positive number of keys; set it to e.g. {KEY_CHUNK} or unset it")
    return int(text)


def _modes() -> dict[str, str]:
    modes = {}
    for env, choices, default in ((ENV_DKV_MODE, DKV_MODES, DEFAULT_DKV_MODE), (ENV_FWD_MODE, FWD_MODES, DEFAULT_FWD_MODE)):
        modes[env] = os.environ.get(env, default)
        if modes[env] not in choices:
            raise GenolongError(f"{env}={modes[env]!r} is not a mode; set it to one of {', '.join(choices)} or unset it")
    return modes


def replay_dsa_sparse_attention(kept, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float,
                                return_lse: bool = False):
    """The op's result from the (out, lse) its forward kept (genolong.train.keep), with this kernel's
    backward: a recompute that does not attend again. Reference: genolong.model.sparse_replay."""
    out, lse = kept
    if out.shape != q.shape or lse.shape != q.shape[:3]:
        raise GenolongError(f"kept sparse-attention result {tuple(out.shape)} / {tuple(lse.shape)} does not match q {tuple(q.shape)}")
    mode = _modes()[ENV_DKV_MODE]
    key_chunk = _key_chunk()
    out, lse = _SparseMLA.apply(q.contiguous(), kv.contiguous(), indices.contiguous(), float(scale), mode, key_chunk,
                                QUERY_BUDGET_BYTES, {}, DEFAULT_FWD_MODE, 2 * key_chunk, (out.contiguous(), lse.contiguous()))
    return (out, lse) if return_lse else out


def dsa_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, return_lse: bool = False):
    """The "dsa_sparse_attention" op (docs/ops.md) on the few-head Triton sparse-MLA kernels.

    Environment: GENOLONG_SPARSE_MLA=off declines (the next implementation, megatron-core's
    TileLang kernel, runs instead); GENOLONG_SPARSE_MLA_DKV picks the dkv mode,
    GENOLONG_SPARSE_MLA_FWD the forward's, GENOLONG_SPARSE_MLA_KEY_CHUNK the keys per chunk,
    GENOLONG_SPARSE_MLA_PACK=off keeps q and dO apart in the backward; opt-in, measured slower on an
    H100 (2026-12-05, docs/kernels.md): GENOLONG_SPARSE_MLA_SPLIT=candidates also times the split score
    products, GENOLONG_SPARSE_MLA_ADDS=layout adds the backward's fp32 sums in the products' layout (sm_90)."""
    if os.environ.get(ENV_SWITCH, "on") == "off":
        raise KernelUnsupported(f"disabled by {ENV_SWITCH}=off")
    _common.require_cuda(q, kv, indices)
    check_supported(q, kv, indices)
    if not math.isfinite(scale):
        raise KernelUnsupported(f"scale must be finite, got {scale}")
    try:
        import genolong.kernels.sparse_mla_triton  # noqa: F401
    except ImportError as why:
        raise KernelUnsupported(f"triton is not importable: {why}") from why
    modes = _modes()
    return sparse_mla(q, kv, indices, scale=scale, return_lse=return_lse, dkv_mode=modes[ENV_DKV_MODE],
                      fwd_mode=modes[ENV_FWD_MODE], key_chunk=_key_chunk())
