"""Builds fla's TileLang KDA-backward kernel in a background thread while a run's first forward runs.

Why: fla 0.6.0 runs the KDA backward's fused dq/dk/dg pass as a TileLang kernel wherever tilelang
and nvcc are usable (the device machine), and builds it at its first call, the first backward:
23-30 s on an H100, added to the first step of any run on a machine that has not built it yet
(docs/performance.md).
The kernel's sequence length is dynamic (`T.dynamic` in fla's builder), so one build at one chunk
of tokens serves every length, and everything else that keys the build (heads, head dims, chunk,
dtype) is known before the first step. The build is TVM passes (tvm_ffi releases the GIL while a
pass runs) and nvcc (a subprocess), so it overlaps the forward's compilation and kernels: ~7 s of
29 measured where the forward's kernels were cached (H100, docs/kernels.md); all of it expected,
not yet measured, on a fresh machine, whose first forward compiles for longer than the build.

`start` runs fla's own entry (`chunk_kda_bwd_wy_dqkg_fused_tilelang`) once on zeros of the run's
shapes, so the build's key is the one the real backward computes; the first backward calls `wait`
first, so the kernel is never built twice at once. Anything that goes wrong is recorded and
logged, never raised: the backward then builds the kernel itself, as without this.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("genolong.kernels")

CHUNK = 64  # fla chunk_kda's chunk size (its default, which genolong uses)


@dataclass(frozen=True)
class KDABackwardShape:
    """What keys the build besides the sequence length: heads on this rank, key / value head dims, dtype."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype


def shape_for(config, *, dtype: torch.dtype, tp: int = 1, cp: int = 1) -> KDABackwardShape | str:
    """The KDA backward this rank will run, or why there is nothing to build ahead (a string).

    Tensor parallelism splits the KDA heads (the kernel's head count is fixed at build time);
    context parallelism runs fla's cp path, whose calls carry cu_seqlens (another build), so it is
    left to build at its first call."""
    if "kda" not in tuple(config.layer_types):
        return "the model has no KDA layers"
    if cp > 1:
        return f"context parallel (cp={cp}) runs fla's cp path, built at its first call"
    heads = config.kda.num_heads
    if heads % tp:
        return f"{heads} KDA heads do not split over tp={tp}"
    return KDABackwardShape(heads // tp, config.kda.head_dim, config.kda.head_dim, dtype)


def _fla_tilelang_builder():
    """fla's TileLang KDA-backward entry, or why it would not run (fla picks Triton, or is absent)."""
    try:
        from fla.backends import _load_operation_registry

        active = _load_operation_registry("kda").get_active()
    except Exception as why:  # fla absent or of another version: nothing to build ahead
        return f"fla's KDA backends are not loadable ({type(why).__name__}: {why})"
    if active is None or active.backend_type != "tilelang":
        return f"fla's KDA backward runs {'its Triton kernels' if active is None else active.backend_type}, not TileLang"
    try:
        from fla.ops.kda.backends.tilelang.chunk_bwd_dqkg import chunk_kda_bwd_wy_dqkg_fused_tilelang
    except Exception as why:
        return f"fla's TileLang KDA backward is not importable ({type(why).__name__}: {why})"
    return chunk_kda_bwd_wy_dqkg_fused_tilelang


def run_on_zeros(builder, shape: KDABackwardShape, device: torch.device) -> None:
    """One call of fla's TileLang backward entry on one chunk of zeros of `shape` (the build is its first call)."""
    h, dk, dv, dt = shape.heads, shape.key_dim, shape.value_dim, shape.dtype
    z = lambda *size, dtype=dt: torch.zeros(size, dtype=dtype, device=device)  # noqa: E731
    builder(
        q=z(1, CHUNK, h, dk), k=z(1, CHUNK, h, dk), v=z(1, CHUNK, h, dv), v_new=z(1, CHUNK, h, dv),
        g=z(1, CHUNK, h, dk, dtype=torch.float32), beta=z(1, CHUNK, h, dtype=torch.float32),
        A=z(1, CHUNK, h, CHUNK), h=z(1, 1, h, dk, dv), do=z(1, CHUNK, h, dv), dh=z(1, 1, h, dk, dv),
        dv=z(1, CHUNK, h, dv), scale=dk**-0.5, chunk_size=CHUNK, state_v_first=False,
    )


class KDABackwardPrebuild:
    """The background build; `wait()` (the first backward) joins it; `describe()` for compile.json."""

    def __init__(self, shape: KDABackwardShape | str, device: torch.device, builder=None):
        if device.type == "cuda" and device.index is None:  # "cuda": the caller's current device, named for the thread
            device = torch.device("cuda", torch.cuda.current_device())
        self.shape, self.device = shape, device
        self.outcome, self.build_s, self.waited_s = "not started", None, None
        self._thread = None
        if isinstance(shape, str):
            self.outcome = f"skipped: {shape}"
            return
        # fla and tilelang are imported here, in the caller's thread: an import racing the forward's
        # own `from fla.ops.kda import chunk_kda` would only contend for the import lock.
        builder = builder if builder is not None else _fla_tilelang_builder()
        if isinstance(builder, str):
            self.outcome = f"skipped: {builder}"
            return
        self._thread = threading.Thread(target=self._build, args=(builder,), name="kda-backward-prebuild", daemon=True)
        self.outcome = "building"
        self._thread.start()

    def _build(self, builder) -> None:
        t0 = time.perf_counter()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # a thread starts on device 0; the kernel is loaded where it runs
            run_on_zeros(builder, self.shape, self.device)
            self.outcome = "built"
        except Exception as why:  # the backward builds it itself then; say why here
            self.outcome = f"failed ({type(why).__name__}: {str(why)[:300]}); the first backward builds it"
        self.build_s = round(time.perf_counter() - t0, 1)

    def wait(self) -> None:
        """Blocks until the build has finished (at once after the first call)."""
        if self._thread is None or self.waited_s is not None:
            return
        t0 = time.perf_counter()
        self._thread.join()
        self.waited_s = round(time.perf_counter() - t0, 1)
        log.info("fla's TileLang KDA backward, built ahead: %s in %s s, of which the first backward waited %s s",
                 self.outcome, self.build_s, self.waited_s)

    def describe(self) -> dict:
        shape = None if isinstance(self.shape, str) else {
            "heads": self.shape.heads, "key_dim": self.shape.key_dim, "value_dim": self.shape.value_dim,
            "dtype": str(self.shape.dtype).removeprefix("torch."),
        }
        return {"outcome": self.outcome, "shape": shape, "build_s": self.build_s, "first_backward_waited_s": self.waited_s}


def start(config, *, device: str | torch.device, dtype: torch.dtype, tp: int = 1, cp: int = 1) -> KDABackwardPrebuild:
    """Starts the build for a run of `config` on `device` (a CUDA device; the caller decides that fused
    kernels run)."""
    return KDABackwardPrebuild(shape_for(config, dtype=dtype, tp=tp, cp=cp), torch.device(device))
