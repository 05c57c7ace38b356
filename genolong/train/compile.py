"""Compiled small ops, applied to a built model from outside (in a 128k glm53-mini step,
26% of the GPU time went to thousands of small pointwise kernels and 11% to skinny 32x32-tile
products, mostly mHC's per-token stream mixes run as [T]-batched 1x4 and 4x4 matrix products).

`apply_compile(model)` is the last module pass (genolong.train.passes): it switches each small-op
module to a subclass of its own class (`CompiledHyperConnection`, `CompiledRMSNorm`, ...; print(model)
shows them) whose methods call a `torch.compile`d function of tensors. The functions are
genolong/model's own eager math (their references), compiled once for every layer: parameters
are arguments, not attributes, so 45 layers share one graph per shape instead of compiling 45
times. Regions:

- mHC (`HyperConnection.forward`): the RMS statistic, the 24-logit projection, sigmoid /
  softmax, Sinkhorn and the pre collapse. Sinkhorn runs as `torch.ops.genolong.mhc_sinkhorn`
  (genolong/kernels/mhc/sinkhorn.py: one Triton kernel per direction, only the input saved) on
  CUDA, or is traced into the graph elsewhere. The collapse is a broadcast multiply-sum in fp32
  (one fused kernel) instead of a [T]-batched 1x4 matrix product.
- mHC expand (`HyperConnection.expand`): post * out + comb^T streams, likewise fused.
- `RMSNorm`, `GatedRMSNorm`, the MoE `Router` (sigmoid scores, bias, top-k, normalisation),
  the dense SwiGLU MLP (also the MoE's shared expert; its GEMMs stay cuBLAS calls). With
  the router's top-k is `torch.ops.genolong.router_topk` (genolong/kernels/moe/router_topk.py: one
  Triton pass instead of torch.topk's radix select; the default on CUDA since 2026-12-05,
  GENOLONG_ROUTER_TOPK=torch goes back to torch.topk).

The token dimension is marked dynamic, so a new sequence length (or the last, shorter MoE
chunk) reuses the graphs instead of compiling again. Compiled regions sit inside the layer, so
they compose with full-layer recompute (non-reentrant checkpoint: the compiled backward's saved
tensors go through the checkpoint's hooks like any other), with the CPU offload's saved-tensor
hooks outside it, and with the hot ops (`genolong.model.ops.call` is never inside a compiled
region, so its audit and fallback policy are unchanged). State-dict keys are untouched (the
parameters stay where they are, only the class changes); `CompileHandle.remove()` switches the
classes back. Only modules of exactly the plain classes are switched: a module another pass
switched (a tensor-parallel MLP) or wrapped for the mHC fp32-input ablation stays eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from genolong import switches
from genolong.errors import GenolongError
from genolong.model.mhc import HyperConnection
from genolong.model.mlp import DenseMLP
from genolong.model.moe import Router
from genolong.model.norms import GatedRMSNorm, RMSNorm


@dataclass
class CompileHandle:
    model: torch.nn.Module
    sinkhorn: str
    switched: list[tuple[torch.nn.Module, type]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _start: dict[str, int] = field(default_factory=dict)

    def describe(self) -> dict:
        """What was compiled, and dynamo's counters since `apply_compile` (graphs, breaks, recompiles,
        seconds spent compiling)."""
        now = _dynamo_counters()
        return {
            "modules": dict(self.counts),
            "sinkhorn": self.sinkhorn,
            **{k: round(now[k] - self._start.get(k, 0), 2) for k in now},
        }

    def remove(self) -> None:
        for module, plain in self.switched:
            module.__class__ = plain
            module.__dict__.pop("triton_sinkhorn", None)
        self.switched = []


def apply_compile(model: torch.nn.Module, *, sinkhorn: str | None = None, mhc: bool = True) -> CompileHandle:
    """Compile the small-op regions of `model` (module docstring). sinkhorn: "triton" (the fused
    kernels through the custom op), "inductor" (traced into the graph), None: triton on CUDA.
    mhc=False leaves mHC to the hot ops (on the GPU, the fused passes of mhc/fused.py, 7-9x the
    eager mHC) and compiles only the norms, the router and the dense MLP."""
    from genolong.train.memory import Fp32InputMHC
    from genolong.train.wrapper import wrappers

    device = next(model.parameters()).device
    if sinkhorn is None:
        sinkhorn = "triton" if device.type == "cuda" and _triton_importable() else "inductor"
    if sinkhorn not in ("triton", "inductor"):
        raise GenolongError(f"sinkhorn must be 'triton' or 'inductor', got {sinkhorn!r}")
    if sinkhorn == "triton":
        import genolong.kernels.mhc.sinkhorn  # noqa: F401  (registers torch.ops.genolong.mhc_sinkhorn)

    handle = CompileHandle(model, sinkhorn, _start=_dynamo_counters())
    eager = {id(w.wrapped) for w in wrappers(model, Fp32InputMHC)}
    switches = {cls.__bases__[0]: cls for cls in _COMPILED_CLASSES}
    for module in model.modules():
        compiled_cls = switches.get(type(module))
        if compiled_cls is None or id(module) in eager or (compiled_cls is CompiledHyperConnection and not mhc):
            continue
        handle.switched.append((module, type(module)))
        module.__class__ = compiled_cls
        if compiled_cls is CompiledHyperConnection:
            module.triton_sinkhorn = sinkhorn == "triton"
        for name in compiled_cls.COMPILED:
            key = f"{compiled_cls.__bases__[0].__name__}.{name}"
            handle.counts[key] = handle.counts.get(key, 0) + 1
    return handle


# ----------------------------------------------------------------------------- compiled functions

_COMPILED: dict[str, object] = {}


def compiled(name: str):
    """The compiled function `name` (created on first use, shared by every model and layer)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_FUNCTIONS[name])
    return _COMPILED[name]


def _tokens_dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def hc_forward(streams, fn, base, scale, n: int, iters: int, eps: float, rms_eps: float, triton_sinkhorn: bool):
    from genolong.model.mhc_math import mix_weights, sinkhorn

    pre, post, comb = mix_weights(streams, fn, base, scale, n=n, eps=eps, rms_eps=rms_eps)
    comb = torch.ops.genolong.mhc_sinkhorn(comb, iters, eps) if triton_sinkhorn else sinkhorn(comb, iters, eps)
    dtype = streams.dtype
    # sum_i pre[i] * streams[i] with the reference's rounding of pre, accumulated in fp32.
    collapsed = (pre.to(dtype).float().unsqueeze(-1) * streams.float()).sum(-2).to(dtype)
    return post, comb, collapsed


def hc_expand(post, comb, out, residual):
    dtype = residual.dtype
    mixed = (comb.to(dtype).float().unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)  # sum_i comb[i, o] res[i]
    return (post.to(dtype).float().unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(dtype)


def _norm(x, weight, eps: float):
    from genolong.model.norms import rms_norm

    return rms_norm(x, weight, eps)


def _gated_norm(x, gate, weight, eps: float):
    from genolong.model.norms import gated_rms_norm

    return gated_rms_norm(x, gate, weight, eps)


def _route(x, weight, bias, cfg, triton_topk: bool):
    from genolong.model.moe import route

    return route(x, weight, bias, cfg, top_indices=torch.ops.genolong.router_topk if triton_topk else None)


def _swiglu(x, gate_w, up_w, down_w, limit: float):
    from genolong.model.mlp import swiglu_mlp

    return swiglu_mlp(x, gate_w, up_w, down_w, limit)


_FUNCTIONS = {"hc_forward": hc_forward, "hc_expand": hc_expand, "rms_norm": _norm, "gated_rms_norm": _gated_norm,
              "route": _route, "swiglu_mlp": _swiglu}


# ----------------------------------------------------------------------------- compiled classes

class CompiledHyperConnection(HyperConnection):
    COMPILED = ("forward", "expand")
    triton_sinkhorn: bool

    def forward(self, streams):
        lead, (n, hidden) = streams.shape[:-2], streams.shape[-2:]
        flat = streams.reshape(-1, n, hidden)
        _tokens_dynamic(flat)
        post, comb, collapsed = compiled("hc_forward")(flat, self.fn, self.base, self.scale, self.n, self.sinkhorn_iters,
                                                       self.eps, self.rms_eps, self.triton_sinkhorn)
        return post.reshape(*lead, n), comb.reshape(*lead, n, n), collapsed.reshape(*lead, hidden)

    def expand(self, post, comb, out, residual):
        lead, (n, hidden) = residual.shape[:-2], residual.shape[-2:]
        args = (post.reshape(-1, n), comb.reshape(-1, n, n), out.reshape(-1, hidden), residual.reshape(-1, n, hidden))
        _tokens_dynamic(*args)
        return compiled("hc_expand")(*args).reshape(*lead, n, hidden)

    def extra_repr(self) -> str:
        return f"compiled, sinkhorn={'triton' if self.triton_sinkhorn else 'inductor'}"


class CompiledRMSNorm(RMSNorm):
    COMPILED = ("forward",)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _tokens_dynamic(flat)
        return compiled("rms_norm")(flat, self.weight, self.eps).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compiled".lstrip(", ")


class CompiledGatedRMSNorm(GatedRMSNorm):
    COMPILED = ("forward",)

    def forward(self, x, gate):
        flat, flat_gate = x.reshape(-1, x.shape[-1]), gate.reshape(-1, gate.shape[-1])
        _tokens_dynamic(flat, flat_gate)
        return compiled("gated_rms_norm")(flat, flat_gate, self.weight, self.eps).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compiled".lstrip(", ")


class CompiledRouter(Router):
    COMPILED = ("forward",)  # (its forward runs the compiled route below)

    def route(self, x, top_indices=None):
        if top_indices is not None:  # (a replayed choice of experts: genolong.model.moe.Router.forward)
            return super().route(x, top_indices)
        _tokens_dynamic(x)
        return compiled("route")(x, self.weight, self.e_score_correction_bias, self.cfg, _router_topk_triton(x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compiled".lstrip(", ")


class CompiledDenseMLP(DenseMLP):
    COMPILED = ("forward",)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _tokens_dynamic(flat)
        out = compiled("swiglu_mlp")(flat, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.swiglu_limit)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compiled".lstrip(", ")


def _router_topk_triton(x: torch.Tensor) -> bool:
    """Whether the compiled router picks its experts with genolong/kernels/moe/router_topk.py's kernel:
    on CUDA unless GENOLONG_ROUTER_TOPK=torch (read at each call, so one process can time both)."""
    if not x.is_cuda or switches.get("GENOLONG_ROUTER_TOPK") == "torch":
        return False
    from genolong.kernels.moe import router_topk  # noqa: F401  (registers torch.ops.genolong.router_topk)

    return True


_COMPILED_CLASSES = (CompiledHyperConnection, CompiledRMSNorm, CompiledGatedRMSNorm, CompiledRouter, CompiledDenseMLP)


# ----------------------------------------------------------------------------- helpers


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _dynamo_counters() -> dict[str, int | float]:
    from torch._dynamo.utils import compilation_time_metrics, counters

    def seconds(name: str) -> float:
        return round(float(sum(compilation_time_metrics.get(name, ()))), 2)

    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
        # Wall seconds in torch.compile: tracing and Inductor (with the backward graphs when they are
        # built with the forward, as under recompute) plus backward graphs built lazily at the first
        # backward. The part of a first step that is torch.compile's; the rest of its extra time is
        # the kernels' own builds, autotuning and the first pinned allocations.
        "compile_s": round(seconds("_compile.compile_inner") + seconds("backward._backward_impl"), 2),
    }
