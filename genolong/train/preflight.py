"""The pre-flight: refuse a run whose step cannot fit, with the numbers and the changes that would fit.

`preflight` (GPU memory and pinned host memory) and `preflight_cpu` (RAM) check the memory plan
(genolong.train.plan) before the model and its activations are allocated; `shortfall` names the
resource that is short and the changes under which the run would fit: memory flags, fewer
offloaded layers, a smaller MoE chunk, more host RAM, more GPUs (the best layout on the fewest,
genolong.train.plan_suggest), a shorter --seq. `genolong plan` prints the same advice.

The dependencies run one way: plan (the estimate) <- plan_suggest (layouts ranked by it) <- this
module (advice that may propose a layout).
"""

from __future__ import annotations

import math

from genolong.errors import GenolongError
from genolong.model.config import ModelConfig
from genolong.train.options import MemoryOptions
from genolong.train.plan import (
    FP32,
    GIB,
    H200_BYTES,
    HOST_USABLE,
    MemoryEstimate,
    choose_tile,
    estimate_cpu_memory,
    estimate_memory,
)
from genolong.train.plan_parallel import ParallelSetup, single_gpu_setup
from genolong.train.plan_suggest import fewest_gpus
from genolong.units import format_length


def preflight(
    model_config: ModelConfig,
    seq_len: int,
    opts: MemoryOptions,
    n_gpus: int = 1,
    gpu_bytes: int | None = None,
    **kw,
) -> MemoryEstimate:
    """Raise GenolongError (numbers, the resource that is short, what would fit) if the step cannot fit; else the estimate."""
    if gpu_bytes is None:
        gpu_bytes = _device_bytes()
    est = estimate_memory(model_config, seq_len, opts, n_gpus, gpu_bytes, **kw)
    if not est.fits and opts.tile_auto and opts.tile_tokens is None:
        tiled = choose_tile(model_config, seq_len, opts, n_gpus, gpu_bytes, **kw)
        if tiled is not None:
            # what the memory pass then applies (genolong.train.memory)
            opts.tile_tokens, opts.keep_sparse, opts.keep_moe = tiled.opts.tile_tokens, tiled.opts.keep_sparse, False
            return tiled
    if not est.fits:
        raise GenolongError(_refusal(model_config, est, shortfall(model_config, seq_len, opts, n_gpus, gpu_bytes, **kw)))
    return est


def preflight_cpu(model_config: ModelConfig, seq_len: int, opts: MemoryOptions, *, batch: int = 1, dtype_bytes: int = FP32, ram_bytes: int | None = None) -> MemoryEstimate:
    """The CPU run's pre-flight: refuse before allocating when the plan exceeds the RAM budget."""
    est = estimate_cpu_memory(model_config, seq_len, opts, batch=batch, dtype_bytes=dtype_bytes, ram_bytes=ram_bytes)
    if not est.fits:
        fixes = shortfall(model_config, seq_len, opts, 1, est.gpu_bytes, device="cpu", batch=batch, dtype_bytes=dtype_bytes, ram_bytes=ram_bytes)
        raise GenolongError(_refusal(model_config, est, fixes))
    return est


def _refusal(config: ModelConfig, est: MemoryEstimate, fixes: list[str]) -> str:
    top = sorted(est.gpu.items(), key=lambda kv: -kv[1])[:3]
    detail = ", ".join(f"{k} {_gib(v)}" for k, v in top)
    offloaded = f", {est.offload_layers} layers offloaded" if est.device != "cpu" else ""
    fix = ("it would fit with " + "; or ".join(fixes)) if fixes else "nothing short of a smaller model makes it fit"
    return (
        f"{config.name} at {format_length(est.seq_len)} tokens does not fit: {_where(est)} (largest: {detail}{offloaded}); "
        f"{fix}; see `genolong plan`"
    )


def _where(est: MemoryEstimate) -> str:
    """The resources that are short, with their numbers."""
    parts = []
    if est.device == "cpu":
        parts.append(f"CPU RAM short: {_gib(est.gpu_total)} > {_gib(est.gpu_bytes)} usable")
    else:
        if not est.fits_gpu:
            parts.append(f"GPU memory short: {_gib(est.gpu_total)} > {_gib(est.gpu_bytes)} usable per GPU")
        if not est.fits_host:
            kind = "pinned host memory" if est.opts.offload_pinned else "host memory"
            parts.append(f"{kind} short: {_gib(est.host_total)} > {_gib(est.host_bytes)} usable per GPU")
    return "; ".join(parts)


def shortfall(
    config: ModelConfig,
    seq_len: int,
    opts: MemoryOptions,
    n_gpus: int,
    gpu_bytes: int,
    *,
    device: str = "cuda",
    batch: int = 1,
    dtype_bytes: int | None = None,
    host_bytes: int | None = None,
    ram_bytes: int | None = None,
    setup: ParallelSetup | None = None,
) -> list[str]:
    """The changes under which a run that does not fit would fit, aimed at the resource that is short:
    memory flags, fewer offloaded layers, a smaller MoE chunk, more host RAM, more GPUs (the best
    layout on the fewest, genolong.train.plan_suggest), a shorter --seq."""
    if device == "cpu":
        a = FP32 if dtype_bytes is None else dtype_bytes

        def trial(seq=seq_len, o=opts):
            return estimate_cpu_memory(config, seq, o, batch=batch, dtype_bytes=a, ram_bytes=ram_bytes)
    else:
        a = 2 if dtype_bytes is None else dtype_bytes
        setup = setup or single_gpu_setup(n_gpus)

        def trial(seq=seq_len, o=opts):
            return estimate_memory(config, seq, o, gpu_bytes=gpu_bytes, batch=batch, dtype_bytes=a, host_bytes=host_bytes, setup=setup)

    est = trial()
    if est.fits:
        return []
    found = _flag_fixes(opts, lambda o: trial(o=o).fits)
    found += _keep_fixes(trial, opts, device)
    if device == "cpu":
        found.append(f"more RAM: {_gib(est.gpu_total / HOST_USABLE)} installed, or --host-budget-gib {math.ceil(est.gpu_total / GIB)}")
    else:
        found += _offload_fixes(est, trial, opts)
        found += _moe_chunk_fixes(config, trial, opts)
        need = math.ceil(est.host_total / GIB)
        if not est.fits_host and trial(o=MemoryOptions.from_dict({**opts.to_dict(), "host_budget_gib": need})).fits:
            node = setup.gpus_on_node
            found.append(f"more host RAM: --host-budget-gib {need} per GPU (a node of {node} GPU(s) with {_gib(need * GIB * node / HOST_USABLE)} of RAM)")
        more = _more_gpus(config, seq_len, opts, gpu_bytes, setup, batch=batch, dtype_bytes=a, host_bytes=host_bytes)
        if more:
            found.append(more)

    def fits_tiled(o: MemoryOptions) -> MemoryEstimate | None:
        """The estimate under `o` if it fits, also with the tile `--tile auto` would pick (GPU, one process)."""
        est = trial(o=o)
        if est.fits:
            return est
        if device != "cpu" and o.tile_auto and o.tile_tokens is None:
            return choose_tile(config, seq_len, o, 1, gpu_bytes, batch=batch, dtype_bytes=a, host_bytes=host_bytes, setup=setup)
        return None

    # Lossy, so after every exact change.
    found += _layer_input_fixes(opts, fits_tiled)
    seq = seq_len // 2
    while seq >= 1024 and not trial(seq=seq).fits:
        seq //= 2
    if seq >= 1024:
        # The longest that fits, to 1k: between the halving's last fit and the length twice it.
        fits, short = seq // 1024 * 1024, min(2 * seq, seq_len)
        while short - fits > 1024:
            mid = (fits + short) // 2 // 1024 * 1024
            if mid <= fits:
                break
            fits, short = (mid, short) if trial(seq=mid).fits else (fits, mid)
        found.append(f"a shorter sequence: --seq {format_length(fits)}")
    elif device == "cpu" and config.name != "tiny":
        found.append("a smaller model (--preset tiny)")  # the weights and optimizer state alone are too much
    return found


def _moe_chunk_fixes(config: ModelConfig, trial, opts: MemoryOptions) -> list[str]:
    """The largest smaller --moe-chunk that fits (uneven routing under ep multiplies a chunk's rows)."""
    if not (config.moe_layers and opts.moe_chunking):
        return []
    chunk = opts.moe_chunk_tokens // 2
    while chunk >= 4096:
        if trial(o=MemoryOptions.from_dict({**opts.to_dict(), "moe_chunk_tokens": chunk})).fits:
            return [f"a smaller MoE chunk: --moe-chunk {format_length(chunk)}"]
        chunk //= 2
    return []


def _more_gpus(config: ModelConfig, seq_len: int, opts: MemoryOptions, gpu_bytes: int, setup: ParallelSetup, **kw) -> str | None:
    """The fewest GPUs (a power of two above today's) on which some layout fits, with that layout."""
    best = fewest_gpus(
        config, seq_len, opts, setup.world, gpu_bytes, kda_mode=setup.kda_mode, optimizer_on_host=setup.optimizer_on_host,
        gpus_per_node=setup.gpus_per_node, moe_skew=setup.moe_skew, micro_batch=kw.pop("batch"), **kw,
    )
    if best is None:
        return None
    flags = f"--gpus {best.setup.world} --parallel {best.setup.layout}" + (" --fsdp" if best.setup.fsdp else "")
    plan_only = f" (a plan: genolong does not run {', '.join(best.blockers)} yet)" if best.blockers else ""
    return f"more GPUs: {flags}{plan_only}"


def _flag_fixes(opts: MemoryOptions, fits) -> list[str]:
    """The memory switches that are off and would make the run fit one at a time, else all together."""
    candidates = [
        ("--recompute", dict(recompute=True)),
        ("--recompute --offload", dict(recompute=True, offload=True, offload_layers=None)),
        ("--moe-chunking", dict(moe_chunking=True)),
        ("--chunked-loss", dict(chunked_loss=True)),
    ]
    changed = lambda change: MemoryOptions.from_dict({**opts.to_dict(), **change})  # noqa: E731
    off = [(flag, change) for flag, change in candidates if not all(getattr(opts, k) == v for k, v in change.items() if k != "offload_layers")]
    found = [flag for flag, change in off if fits(changed(change))]
    full = dict(recompute=True, offload=True, offload_layers=None, moe_chunking=True, chunked_loss=True)
    if not found and len(off) > 1 and fits(changed(full)):
        found.append("the full memory stack (drop --baseline / every --no-* flag)")
    return found


def _keep_fixes(trial, opts: MemoryOptions, device: str) -> list[str]:
    """Kept DSA results moved off the GPU (to pinned memory) or not kept at all, if that fits; kept MoE
    outputs not kept."""
    if opts.keeps_moe() and trial(o=MemoryOptions.from_dict({**opts.to_dict(), "keep_moe": False})).fits:
        return ["the MoE outputs recomputed, not kept: drop --keep-moe"]
    where = opts.kept_where()
    if where is None:
        return []
    choices = ["host"] if where == "device" and opts.offload and device != "cpu" else []
    for choice in choices + ["off"]:
        if trial(o=MemoryOptions.from_dict({**opts.to_dict(), "keep_sparse": choice})).fits:
            why = "in pinned host memory" if choice == "host" else "recomputed, not kept"
            return [f"the DSA results {why}: --keep-sparse {choice}"]
    return []


def _layer_input_fixes(opts: MemoryOptions, fits) -> list[str]:
    """fp8 storage of the layer inputs (about half their bytes, on the GPU and the host), if that fits."""
    if not opts.recompute or opts.layer_inputs == "fp8":
        return []
    est = fits(MemoryOptions.from_dict({**opts.to_dict(), "layer_inputs": "fp8"}))
    if est is None:
        return []
    tiled = f" (with --tile {format_length(est.opts.tile_tokens)})" if est.opts.tile_tokens is not None and opts.tile_tokens is None else ""
    return [f"the layer inputs stored in fp8 (e4m3 with per-row scales; lossy: backward recomputes from them): --layer-inputs fp8{tiled}"]


def _offload_fixes(est: MemoryEstimate, trial, opts: MemoryOptions) -> list[str]:
    """A fixed --offload-layers that is wrong for this run: the count that fits both GPU and host."""
    if not (opts.offload and opts.recompute and opts.offload_layers is not None):
        return []
    auto = trial(o=MemoryOptions.from_dict({**opts.to_dict(), "offload_layers": None}))
    if auto.fits and auto.offload_layers != opts.offload_layers:
        fewer = "fewer" if auto.offload_layers < opts.offload_layers else "more"
        return [f"{fewer} offloaded layers: --offload-layers {auto.offload_layers} (or leave it unset)"]
    return []


def fixes_for(config: ModelConfig, seq_len: int, opts: MemoryOptions, n_gpus: int, gpu_bytes: int, **kw) -> list[str]:
    """The memory flags alone (one at a time, else together) under which this run would fit."""
    return _flag_fixes(opts, lambda o: estimate_memory(config, seq_len, o, n_gpus, gpu_bytes, **kw).fits)


def _device_bytes() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    except Exception:
        pass
    return H200_BYTES


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
