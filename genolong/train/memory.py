"""The memory passes: switch each memory optimization on a built model, from outside the model.

`apply_memory_optimizations(model, opts)` reads genolong.train.options.MemoryOptions, wraps
modules (print(model) shows every wrapper; state-dict keys and parameter names are unchanged,
genolong.train.wrapper) and returns a `MemoryHandle` (the loop reads `stats.peak_pinned_bytes`
and calls `reset_stats()` per step; `remove()` unwraps everything). In the pass order of
genolong.train.passes: MoE chunking and the mHC switch first (they wrap modules inside a layer),
then recompute and offload (they wrap whole layers):

- moe_chunking: `ChunkedMoE(MoE)` runs the MoE over the sequence in chunks of `moe_chunk_tokens`
  tokens, each chunk under its own checkpoint. The chunking bounds the transient of skewed
  real-data routing (the original recipe's real-data MoE chunking); the checkpoint is what makes it pay under full
  recompute, where a layer's whole activation set is alive during its backward: the MoE then
  keeps one chunk's activations instead of the sequence's, for one extra MoE forward per layer.
- mhc_low_precision=False (ablation / --baseline only): `Fp32InputMHC(HyperConnection)` runs the
  mHC projection on an fp32 copy of its input, as an out-of-the-box port does. The model never
  keeps one (genolong.model.mhc applies the fp32 RMS statistic to the 24 logits instead); this
  switch puts it back so the ablation can measure what it costs (the compile pass leaves it eager).
- recompute: `Recompute(DecoderLayer)` (genolong.train.recompute): whole layers under a
  non-reentrant checkpoint; with `tile_tokens`, `Tiled(DecoderLayer)` (genolong.train.tiling)
  instead: each layer in checkpointed sequence tiles (and the MoE is not chunked: a tile bounds it).
- layer_inputs="fp8": the `Offload` wrappers' HostOffloader stores every checkpointed input (offloaded
  or kept on the device) as fp8 e4m3 with per-row scales; without offload it is there for that alone,
  every layer's input kept on the device. The recompute then routes with the forward's choice of
  experts (genolong.model.moe.KEPT_ROUTE, kept by the KeptResults below, on the device when nothing
  else is kept).
- offload: `Offload(Recompute(...))` (genolong.train.offload): the checkpointed input goes to a
  HostOffloader's host pool. `offload_layers=None` decides per sequence length, at the first
  layer of a forward: the fewest layers that make the plan (genolong.train.plan) fit the GPU
  budget, the *first* layers (their inputs wait longest for backward, so their uploads have the
  most time to overlap). On a machine without CUDA there is no device memory to save, so None
  offloads nothing there; an explicit count still runs the (pageable) offload path, which is how
  the CPU tests use it.
- keep_sparse (with recompute): a `KeptResults` (genolong.train.keep) given to every Recompute
  wrapper: the recompute takes the DSA layers' selections and sparse attention from the forward
  ("host": parked in the offloader's pinned pool; "device": kept on the GPU; "off": recomputed).
  keep_moe (opt-in): the same keeper also keeps each chunked MoE's output, so the layer's recompute
  does not run the MoE (genolong.train.keep_moe); it waits where the DSA results do (with
  keep_sparse off: in the pinned pool when offload is on, else on the GPU).
- chunked_loss is the loop's (genolong.train.loss).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from genolong.model import frames, ops
from genolong.model.moe import KEPT_ROUTE
from genolong.train.keep import KeptResults
from genolong.train.keep_moe import KEPT_OP as KEPT_MOE
from genolong.train.keep_moe import kept_moe_output
from genolong.train.offload import HostOffloader, Offload, OffloadStats
from genolong.train.options import MemoryOptions
from genolong.train.recompute import Recompute, apply_recompute, checkpointed, decoder_body
from genolong.train.tiling import Tiled, apply_tiling
from genolong.train.wrapper import ModuleWrapper, unwrap, wrap


class ChunkedMoE(ModuleWrapper):
    """The wrapped MoE over the flattened tokens in checkpointed chunks (every step of the MoE is
    per token, so the result equals the unchunked one)."""

    def __init__(self, module: torch.nn.Module, chunk_tokens: int) -> None:
        super().__init__(module)
        self.chunk_tokens = chunk_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.reshape(-1, x.shape[-1]).shape[0] <= self.chunk_tokens:
            return self.wrapped(x)
        frame = frames.current_frame() if torch.is_grad_enabled() else None
        if frame is not None and frame.keeps(KEPT_MOE):  # keep_moe: the recompute takes the forward's output
            return kept_moe_output(self.wrapped, x, self.chunk_tokens, frame)
        return self.checkpointed_chunks(x)

    def checkpointed_chunks(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        frame = frames.current_frame() if torch.is_grad_enabled() else None
        routes = frame is not None and frame.keeps(KEPT_ROUTE)
        pieces = []
        for start in range(0, flat.shape[0], self.chunk_tokens):
            piece = flat[start : start + self.chunk_tokens]
            if torch.is_grad_enabled():
                keep = _ChunkRoutes(frame) if routes else None
                pieces.append(checkpointed(self.wrapped, piece, preserve_rng_state=False, keep=keep))
            else:
                pieces.append(self.wrapped(piece))
        return torch.cat(pieces, dim=0).view_as(x)

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}, each chunk checkpointed"


class _ChunkRoutes:
    """The replay frame of one MoE chunk's checkpoint inside a layer frame that keeps the router's choice.

    The chunk's forward runs inside the layer's forward (the choice is recorded in the layer's frame) or
    inside its recompute (taken from it); the chunk's own recompute runs later in backward, outside the
    layer's frame, and takes the choice its forward saw from here."""

    def __init__(self, parent) -> None:
        self.parent = parent
        self.replaying = parent.replaying
        self.seen: list[tuple] = []
        self.cursor = 0

    def keeps(self, op: str) -> bool:
        return op == KEPT_ROUTE

    def record(self, op: str, layer_idx: int, impl: str, args: tuple, kept) -> None:
        self.parent.record(op, layer_idx, impl, args, kept)
        self.seen.append((impl, kept))

    def replay(self, op: str, layer_idx: int, args: tuple) -> tuple:
        if self.cursor < len(self.seen):  # (the chunk's recompute)
            self.cursor += 1
            return self.seen[self.cursor - 1]
        got = self.parent.replay(op, layer_idx, args)
        self.seen.append(got)
        self.cursor += 1
        return got

    def context_fn(self):
        policy_forward, policy_recompute = ops.recompute_context()
        return (_joined(policy_forward, frames.replay_frame(self)),
                frames.Reenterable(lambda: _joined(policy_recompute, self._recomputing())))

    @contextlib.contextmanager
    def _recomputing(self):
        self.replaying, self.cursor = True, 0
        with frames.replay_frame(self):
            yield


@contextlib.contextmanager
def _joined(first, second):
    with first, second:
        yield


class Fp32InputMHC(ModuleWrapper):
    """The wrapped hyper-connection on an fp32 copy of its input (what the original recipe's no-needless-fp32 removed)."""

    def forward(self, streams: torch.Tensor):
        post, comb, collapsed = self.wrapped(streams.float())
        return post, comb, collapsed.to(streams.dtype)

    def extra_repr(self) -> str:
        return "ablation: reads an fp32 copy of its input"


@dataclass
class MemoryHandle:
    model: torch.nn.Module
    opts: MemoryOptions
    recompute: list[Recompute] = field(default_factory=list)
    offloader: HostOffloader | None = None
    keep: KeptResults | None = None

    @property
    def stats(self) -> OffloadStats | None:
        return self.offloader.stats if self.offloader is not None else None

    def recompute_calls(self) -> int:
        """Checkpointed layer calls so far (tests: the wrappers really ran)."""
        return sum(w.calls for w in self.recompute)

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
            return list(range(len(decoder_body(self.model).layers)))
        return sorted(self.offloader.layers)

    def reset_stats(self) -> None:
        if self.offloader is not None:
            self.offloader.reset_stats()
        if self.keep is not None:
            self.keep.reset_stats()

    def release_host(self) -> None:
        """Give the offload pool's host buffers back now (between steps every buffer is free; a next step
        pins them again). Before a run's last checkpoint: the pool is up to ~100 GiB at 1M, and the save
        copies the optimizer state to host memory."""
        if self.offloader is not None:
            self.offloader.release()

    def tile_tokens(self) -> int | None:
        """The tile length of the layers (genolong.train.tiling), None for whole layers."""
        tiled = [w.tile_tokens for w in self.recompute if isinstance(w, Tiled)]
        return tiled[0] if tiled else None

    def describe(self) -> dict:
        return {
            "recompute": bool(self.recompute),
            "offload_layers": self.offload_layers(),
            "moe_chunk_tokens": self.opts.moe_chunk_tokens if self.opts.moe_chunking and self.tile_tokens() is None else None,
            "tile_tokens": self.tile_tokens(),
            "mhc_fp32_input": not self.opts.mhc_low_precision,
            "pinned": self.opts.offload_pinned,
            "overlap": self.opts.offload_overlap,
            "layer_inputs": self.offloader.storage if self.offloader is not None else "bf16",
            "keep_sparse": self.keep.where if self.keep is not None and self.opts.kept_where() else "off",
            "keep_moe": self.keep.where if self.keep is not None and KEPT_MOE in self.keep.ops else "off",
        }

    def remove(self) -> None:
        """Undo every wrapper (the model runs exactly as built again) and free the host pool."""
        for kind in (Offload, Recompute, ChunkedMoE, Fp32InputMHC):
            unwrap(self.model, kind)
        self.recompute = []
        self.keep = None
        if self.offloader is not None:
            self.offloader.release()


def apply_memory_optimizations(model: torch.nn.Module, opts: MemoryOptions) -> MemoryHandle:
    """Switch on what `opts` asks for (module docstring); returns the handle that undoes it."""
    opts.validate()
    handle = MemoryHandle(model, opts)
    tiled = opts.recompute and opts.tile_tokens is not None
    if opts.moe_chunking and not tiled:  # (under tiling a tile's MoE runs whole: the tile bounds it)
        _wrap_all(model, _moe_class(), ChunkedMoE, chunk_tokens=opts.moe_chunk_tokens)
    if not opts.mhc_low_precision:
        _wrap_all(model, _hyper_connection_class(), Fp32InputMHC)
    if opts.recompute:
        handle.recompute = apply_tiling(model, opts.tile_tokens) if tiled else apply_recompute(model)
        if opts.offload or opts.layer_inputs == "fp8":  # (fp8 storage without offload: every input kept, in fp8)
            _apply_offload(handle, model, opts)
        # fp8 layer inputs: the recompute routes with the forward's choice of experts (kept with the DSA
        # results, else on the device: T x top_k small integers a MoE layer).
        replays_routing = opts.layer_inputs == "fp8"
        where = opts.kept_where() or opts.kept_moe_where() or ("device" if replays_routing else None)
        kept_ops = (*(frames.keepable_ops() if opts.kept_where() else ()), *((KEPT_MOE,) if opts.keeps_moe() else ()),
                    *((KEPT_ROUTE,) if replays_routing else ()))
        if where == "host" and opts.keep_sparse != "host" and not _on_cuda(model):
            where = "device"  # host and device memory are one RAM: a copy would only cost time
        if where is not None:
            handle.keep = KeptResults(where, handle.offloader, ops_kept=kept_ops)
            for wrapper in handle.recompute:
                wrapper.keep = handle.keep
    return handle


def _apply_offload(handle: MemoryHandle, model: torch.nn.Module, opts: MemoryOptions) -> None:
    body = decoder_body(model)
    opts.check_layers(len(body.layers))
    budgeted = opts.offload and opts.offload_layers is None
    handle.offloader = HostOffloader(
        layers=() if budgeted or not opts.offload else range(opts.offload_layers),
        pinned=opts.offload_pinned,
        overlap=opts.offload_overlap,
        host_budget_bytes=int(opts.host_budget_gib * 2**30) if opts.host_budget_gib is not None else None,
        storage=opts.layer_inputs,
    )
    decide = OffloadBudget(body.config, opts) if budgeted else None
    for i in range(len(body.layers)):
        wrap(body.layers, str(i), Offload, handle.offloader, i, decide=decide if i == 0 else None)


class OffloadBudget:
    """How many leading layers offload at a sequence length: the plan's answer for the device's memory."""

    def __init__(self, config, opts: MemoryOptions) -> None:
        self.config = config
        self.opts = opts
        self.decided: dict[tuple[int, torch.dtype], int] = {}

    def __call__(self, streams: torch.Tensor) -> int:
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

    def __repr__(self) -> str:
        return "OffloadBudget(from genolong.train.plan)"


def _wrap_all(model: torch.nn.Module, cls: type, wrapper: type[ModuleWrapper], **kwargs) -> None:
    """Wrap every module of exactly class `cls` (or a subclass a parallel pass switched it to) once."""
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, cls) and not isinstance(parent, wrapper):
                wrap(parent, name, wrapper, **kwargs)


def _moe_class() -> type:
    from genolong.model.moe import MoE

    return MoE


def _hyper_connection_class() -> type:
    from genolong.model.mhc import HyperConnection

    return HyperConnection


def _on_cuda(model: torch.nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())
