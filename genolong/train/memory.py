"""Switch the memory optimizations on a built model, each independently, from outside the model.

`apply_memory_optimizations(model, opts)` reads genolong.train.options.MemoryOptions and returns
a `MemoryHandle` (the loop reads `stats.peak_pinned_bytes` and calls `reset_stats()` per step):

- recompute: `model.layer_runner` = genolong.train.recompute.LayerRunner (whole layers under a
  non-reentrant checkpoint).
- offload: the runner wraps each checkpoint in a genolong.train.offload.HostOffloader's hooks.
  `offload_layers=None` decides per sequence length, at the first layer of a forward: the
  fewest layers that make the plan (genolong.train.plan) fit the GPU budget, the *first* layers
  (their inputs wait longest for backward, so their uploads have the most time to overlap). On
  a machine without CUDA there is no device memory to save, so None offloads nothing there;
  an explicit count still runs the (pageable) offload path, which is how the CPU tests use it.
- moe_chunking: each MoE runs over the sequence in chunks of `moe_chunk_tokens` tokens, each
  chunk under its own checkpoint. The chunking bounds the transient of skewed real-data routing
  (seed optimization 8); the checkpoint is what makes it pay under full recompute, where a
  layer's whole activation set is alive during its backward: the MoE then keeps one chunk's
  activations instead of the sequence's, for one extra MoE forward per layer.
- mhc_low_precision=False (ablation / --baseline only): the mHC projection reads an fp32 copy of
  its input, as an out-of-the-box port does. The model never keeps one (genolong.model.mhc
  applies the fp32 RMS statistic to the 24 logits instead); this switch puts it back so the
  ablation can measure what it costs.
- chunked_loss is the loop's (genolong.train.loss).

Nothing here changes a parameter or a state-dict key: the runner is an attribute, the MoE and
mHC switches are per-instance `forward` overrides, and `MemoryHandle.remove()` undoes all of it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from genolong.train.offload import HostOffloader, OffloadStats
from genolong.train.options import MemoryOptions
from genolong.train.recompute import LayerRunner


@dataclass
class MemoryHandle:
    model: torch.nn.Module
    opts: MemoryOptions
    runner: LayerRunner | None = None
    offloader: HostOffloader | None = None
    patched: list[torch.nn.Module] = field(default_factory=list)

    @property
    def stats(self) -> OffloadStats | None:
        return self.offloader.stats if self.offloader is not None else None

    def pinned_bytes(self) -> int:
        """Host bytes holding offloaded layer inputs right now (0 between steps)."""
        return self.offloader.pinned_bytes() if self.offloader is not None else 0

    def reserved_bytes(self) -> int:
        """Host bytes the offload pool holds (reused from step to step)."""
        return self.offloader.reserved_bytes() if self.offloader is not None else 0

    def offload_layers(self) -> list[int]:
        if self.offloader is None:
            return []
        if self.offloader.layers is None:
            return list(range(len(_layers(self.model))))
        return sorted(self.offloader.layers)

    def reset_stats(self) -> None:
        if self.offloader is not None:
            self.offloader.reset_stats()

    def describe(self) -> dict:
        return {
            "recompute": self.runner is not None,
            "offload_layers": self.offload_layers(),
            "moe_chunk_tokens": self.opts.moe_chunk_tokens if self.opts.moe_chunking else None,
            "mhc_fp32_input": not self.opts.mhc_low_precision,
            "pinned": self.opts.offload_pinned,
            "overlap": self.opts.offload_overlap,
        }

    def remove(self) -> None:
        """Undo every switch (the model runs exactly as built again) and free the host pool."""
        _inner(self.model).layer_runner = None
        for module in self.patched:
            module.__dict__.pop("forward", None)
        self.patched = []
        if self.offloader is not None:
            self.offloader.release()


def apply_memory_optimizations(model: torch.nn.Module, opts: MemoryOptions) -> MemoryHandle:
    """Switch on what `opts` asks for (module docstring); returns the handle that undoes it."""
    opts.validate()
    handle = MemoryHandle(model, opts)
    if opts.recompute:
        if opts.offload:
            layers = None if opts.offload_layers is None else range(opts.offload_layers)
            handle.offloader = HostOffloader(
                layers=layers if layers is not None else (),
                pinned=opts.offload_pinned,
                overlap=opts.offload_overlap,
                host_budget_bytes=int(opts.host_budget_gib * 2**30) if opts.host_budget_gib is not None else None,
            )
        handle.runner = _BudgetedRunner(model, opts, handle.offloader) if opts.offload and opts.offload_layers is None else LayerRunner(offloader=handle.offloader)
        _inner(model).layer_runner = handle.runner
    if opts.moe_chunking:
        for module in _moe_modules(model):
            _override(handle, module, _chunked_moe_forward, chunk_tokens=opts.moe_chunk_tokens)
    if not opts.mhc_low_precision:
        for module in _hyper_connections(model):
            _override(handle, module, _fp32_input_hc_forward)
    return handle


class _BudgetedRunner(LayerRunner):
    """A LayerRunner whose offloaded layers are chosen from the plan when the length is first seen."""

    def __init__(self, model: torch.nn.Module, opts: MemoryOptions, offloader: HostOffloader) -> None:
        super().__init__(offloader=offloader)
        self.config = _inner(model).config
        self.opts = opts
        self.decided: dict[tuple[int, torch.dtype], int] = {}

    def __call__(self, layer_idx, layer, hidden_streams, *args, **kwargs):
        if layer_idx == 0 and torch.is_grad_enabled():
            self.offloader.layers = frozenset(range(self._count(hidden_streams)))
        return super().__call__(layer_idx, layer, hidden_streams, *args, **kwargs)

    def _count(self, streams: torch.Tensor) -> int:
        if streams.device.type != "cuda":
            return 0
        tokens = streams.shape[0] * streams.shape[1]
        key = (tokens, streams.dtype)
        if key not in self.decided:
            from genolong.train.plan import estimate_memory

            total = torch.cuda.get_device_properties(streams.device).total_memory
            est = estimate_memory(self.config, tokens, self.opts, 1, total, dtype_bytes=streams.element_size())
            self.decided[key] = est.offload_layers
        return self.decided[key]


def _chunked_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    """MoE over the flattened tokens in checkpointed chunks (every step of the MoE is per token,
    so the result equals the unchunked one)."""
    chunk = self._genolong_chunk_tokens
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= chunk:
        return type(self).forward(self, x)
    run = _class_forward(self)
    pieces = []
    for start in range(0, flat.shape[0], chunk):
        piece = flat[start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(run, piece, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(run(piece))
    return torch.cat(pieces, dim=0).view_as(x)


def _class_forward(module: torch.nn.Module):
    """The module's own (class) forward, bypassing the instance override."""
    cls_forward = type(module).forward

    def run(piece: torch.Tensor) -> torch.Tensor:
        return cls_forward(module, piece)

    return run


def _fp32_input_hc_forward(self, streams: torch.Tensor):
    """The hyper-connection on an fp32 copy of its input (what seed optimization 7 removed)."""
    post, comb, collapsed = type(self).forward(self, streams.float())
    return post, comb, collapsed.to(streams.dtype)


def _override(handle: MemoryHandle, module: torch.nn.Module, fn, **attrs) -> None:
    for key, value in attrs.items():
        setattr(module, f"_genolong_{key}", value)
    module.forward = types.MethodType(fn, module)
    handle.patched.append(module)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """GenoLongModel (the module with the layer loop) of a GenoLongForCausalLM or itself."""
    return model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model


def _layers(model: torch.nn.Module):
    return _inner(model).layers


def _moe_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from genolong.model.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def _hyper_connections(model: torch.nn.Module) -> list[torch.nn.Module]:
    from genolong.model.mhc import HyperConnection

    return [m for m in model.modules() if isinstance(m, HyperConnection)]
