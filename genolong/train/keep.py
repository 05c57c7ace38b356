"""Kept results under full recompute: a layer's recompute takes its DSA selection and sparse
attention from its forward instead of computing them again.

Full recompute (genolong.train.recompute) runs every layer's forward twice. For the DSA layers the
second run repeats their two most expensive steps, whose results are cheap to keep: the indexer's
selection (int32 [T, W]) and the sparse attention's output and lse ([T, H, Dl] + fp32 [T, H]),
from which the attention's backward is computed exactly as after a fresh forward (the replays,
genolong.model.sparse_replay and genolong.kernels.sparse_mla.op). In the 128k profile of glm53-mini
these two steps ran twice per step for ~1.7 s of 11 s (H200, 2026-12-01).

How: `KeptResults.context_fn` is the checkpoint's context_fn of every layer (Recompute(keep=...)).
For each checkpointed call it opens a `ReplayFrame` (genolong.model.frames.replay_frame): in the
forward the frame records, for the keepable ops (`frames.keepable_ops()`), which implementation ran
and the tensors it returned; in the recompute it checks that the same op of the same layer with
the same input shapes asks again, and hands the kept tensors to that implementation's replay.
An implementation without a replay (megatron-core's TileLang kernel) is recorded as such and runs
again. A side effect worth having: the recompute cannot select differently from the forward (ties
broken another way by a nondeterministic top-k would otherwise give the backward other keys).

Where the tensors wait (`where`):
- "host": parked in host memory through the HostOffloader's pinned pool (copied down on its own
  stream as soon as they exist). When backward's recompute of a layer starts, the uploads of that
  layer's tensors and of the next layer backward will recompute begin, so a copy overlaps a layer
  of compute and at most two layers' kept tensors are on the GPU. This is the default: for
  glm53-mini (4 heads, the selection packed: genolong.model.kept_selection) 0.75 GiB per DSA layer
  at 128k and 3 GiB at 512k stay off the GPU (8.3 / 33 GiB pinned for its 11 DSA layers).
- "device": kept on the GPU until the layer's backward (short sequences; what a CPU run uses).

With fp8 layer inputs the same frames keep each MoE layer's choice of experts (genolong.model.moe.KEPT_ROUTE,
recorded and replayed by the Router itself), so the recompute on the rebuilt input routes as the forward did.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from genolong.errors import GenolongError
from genolong.model import frames, ops

WHERE = ("host", "device")


@dataclass
class KeepStats:
    recorded: int = 0  # op results recorded in forwards since the last reset
    replayed: int = 0  # recompute calls served from a kept result
    rerun: int = 0  # recompute calls of an implementation without a replay
    bytes_kept: int = 0


@dataclass(eq=False)
class _Entry:
    op: str
    layer_idx: int
    impl: str
    signature: tuple
    handles: tuple | None  # the kept tensors (store handles); None: not replayable, runs again
    pending: frames.DeferredKept | None = None  # kept tensors not chosen yet (stored by resolve_pending)


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else None for a in args)


class ReplayFrame:
    """One checkpointed layer call: what its forward recorded, and where its recompute is."""

    def __init__(self, owner: KeptResults) -> None:
        self.owner = owner
        self.replaying = False
        self.entries: list[_Entry] = []
        self.cursor = 0

    def keeps(self, op: str) -> bool:
        return op in self.owner.ops

    def record(self, op: str, layer_idx: int, impl: str, args: tuple, kept) -> None:
        """kept: the tensors to keep, None (not replayable) or an frames.DeferredKept, stored once it has
        resolved: when the next op records or the forward ends (`resolve_pending`), whichever is first."""
        self.resolve_pending()
        if isinstance(kept, frames.DeferredKept):
            self.entries.append(_Entry(op, layer_idx, impl, _signature(args), None, pending=kept))
        else:
            handles = None if kept is None else tuple(self.owner.store(t, layer_idx) for t in kept)
            self.entries.append(_Entry(op, layer_idx, impl, _signature(args), handles))
        self.owner.stats.recorded += 1

    def resolve_pending(self) -> None:
        for entry in self.entries:
            if entry.pending is not None:
                kept, entry.pending = entry.pending.resolve(), None
                entry.handles = tuple(self.owner.store(t, entry.layer_idx) for t in kept)

    def replay(self, op: str, layer_idx: int, args: tuple) -> tuple[str, tuple | None]:
        if self.cursor >= len(self.entries):
            raise GenolongError(
                f"layer {layer_idx}: its recompute calls {op!r} more often than its forward did; the layer's "
                "forward must make the same op calls each time (run with --keep-sparse off to recompute everything)"
            )
        self.resolve_pending()  # (a forward that ended without the frame's exit: resolved here at the latest)
        entry = self.entries[self.cursor]
        self.cursor += 1
        if (entry.op, entry.layer_idx, entry.signature) != (op, layer_idx, _signature(args)):
            raise GenolongError(
                f"layer {layer_idx}: its recompute called {op!r} where its forward called {entry.op!r} of layer "
                f"{entry.layer_idx} (or with other input shapes); the layer's forward must make the same op calls "
                "each time (run with --keep-sparse off to recompute everything)"
            )
        if entry.handles is None:
            self.owner.stats.rerun += 1
            return entry.impl, None
        self.owner.stats.replayed += 1
        return entry.impl, tuple(self.owner.retrieve(h) for h in entry.handles)

    def prefetch(self) -> None:
        for entry in self.entries:
            for handle in entry.handles or ():
                self.owner.prefetch(handle)

    def has_kept(self) -> bool:
        return any(e.handles for e in self.entries)


class KeptResults:
    """Keeps the keepable ops' results of every checkpointed layer call for its recompute (module doc).

    where: "host" or "device"; offloader: the HostOffloader whose pinned pool holds them ("host"; the
    memory pass shares the one that holds the layer inputs, so one budget covers both).
    """

    def __init__(self, where: str = "host", offloader=None, ops_kept=None) -> None:
        if where not in WHERE:
            raise GenolongError(f"--keep-sparse must be one of off, {', '.join(WHERE)}; got {where!r}")
        if where == "host" and offloader is None:
            raise GenolongError("keeping results in host memory needs a HostOffloader (genolong.train.offload)")
        self.where = where
        self.offloader = offloader
        self.ops = frozenset(frames.keepable_ops() if ops_kept is None else ops_kept)
        self.stats = KeepStats()
        # This step's frames in forward order, weakly (the autograd graph owns them).
        self._frames: list[weakref.ReferenceType] = []

    # -- the checkpoint's context_fn -----------------------------------------------------------

    def context_fn(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(forward context, recompute context) of one checkpointed call: the frame records, then replays,
        and the recompute runs under the kernel policy in force at forward (ops.recompute_context)."""
        frame = ReplayFrame(self)
        self._frames = [f for f in self._frames if f() is not None]
        self._frames.append(weakref.ref(frame))
        policy_forward, policy_recompute = ops.recompute_context()
        return (_joined(policy_forward, _recording(frame)),
                frames.Reenterable(lambda: _joined(policy_recompute, self._replaying(frame))))

    @contextlib.contextmanager
    def _replaying(self, frame: ReplayFrame):
        frame.replaying = True
        frame.cursor = 0
        frame.prefetch()
        # The layer backward recomputes next is the one recorded before this one.
        alive = [f() for f in self._frames]
        if frame in alive:
            for earlier in reversed(alive[: alive.index(frame)]):
                if earlier is not None and earlier.has_kept():
                    earlier.prefetch()
                    break
        with frames.replay_frame(frame):
            yield

    # -- where the tensors wait ------------------------------------------------------------------

    def store(self, t: torch.Tensor, layer_idx: int):
        t = t.detach()
        self.stats.bytes_kept += t.numel() * t.element_size()
        if self.where == "host":  # (on a CPU, a pageable copy: how the CPU tests run this path)
            return self.offloader.park(t, layer_idx)
        return t

    def prefetch(self, handle) -> None:
        if not isinstance(handle, torch.Tensor):
            self.offloader.prefetch(handle)

    def retrieve(self, handle) -> torch.Tensor:
        return handle if isinstance(handle, torch.Tensor) else self.offloader.take(handle)

    def reset_stats(self) -> None:
        self.stats = KeepStats()

    def __repr__(self) -> str:
        return f"KeptResults({self.where!r}, ops={sorted(self.ops)})"


@contextlib.contextmanager
def _recording(frame: ReplayFrame):
    """The forward of a checkpointed call: its keepable ops record into `frame`; what is still to be
    chosen when the forward ends is chosen then (its tensors must not outlive the forward on the GPU)."""
    with frames.replay_frame(frame):
        yield
    frame.resolve_pending()


@contextlib.contextmanager
def _joined(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager):
    with first, second:
        yield
