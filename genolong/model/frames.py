"""What a checkpointed layer's ops see: replay frames (kept results) and the checkpoint flag.

The kernel policy and the registry of implementations are genolong.model.ops; this module holds
the state a recompute adds around them, and imports nothing of the model, so that the policy,
the kernels and the training passes all build on it.

Kept results. Full recompute (genolong.train.recompute) runs every layer's forward twice. For an
op whose result is expensive and cheap to store (the indexer's selection; the sparse attention's
output and lse, from which its backward is computed), genolong.train.keep opens a replay frame
around a checkpointed layer: in the forward the frame records the op's result, in the recompute
it hands it back, and the op does not run again (`ops.KernelPolicy.call` consults the frame). An
op is keepable when it has a `KeepSpec`; an implementation is replayable when it has a replay
function (`register_replay`; ANY: every implementation of the op). A replay returns what the op
would, with the op's own gradient (docs/ops.md).

The checkpoint flag (`checkpointed`) is true inside a layer checkpoint's forward and recompute
(`checkpointed_scope`, entered by `ops.recompute_context`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KeepSpec:
    """How an op's results are recorded: the recorded call runs without gradient with `record_kwargs`
    added (e.g. ask for the lse the replay needs); `kept(result, kwargs)` -> the tensors to keep
    (kwargs: the call's). Both the forward's and the recompute's result then come from the
    implementation's replay."""

    record_kwargs: Mapping[str, object] = field(default_factory=dict)
    kept: Callable = lambda out, kwargs: (out,)


class DeferredKept:
    """What a KeepSpec's `kept` may return instead of the tensors: the choice of what to keep is made
    later, once the device has answered a question about the result without a host sync
    (genolong.model.kept_selection.PendingPack). The replay frame calls `resolve()` (-> the tensors
    to keep) once, before the layer's forward ends; until then the replay in the forward sees the
    object itself."""

    def resolve(self) -> tuple:
        raise NotImplementedError


ANY = "*"
_KEEPABLE: dict[str, KeepSpec] = {}
_REPLAYS: dict[tuple[str, str], Callable] = {}
_FRAME: contextvars.ContextVar[object | None] = contextvars.ContextVar("genolong_replay_frame", default=None)


def register_keepable(op: str, spec: KeepSpec) -> None:
    _KEEPABLE[op] = spec


def register_replay(op: str, impl: str, fn: Callable) -> None:
    """`fn(kept, *args, **kwargs)` replays implementation `impl` (or ANY) of `op` from its kept tensors."""
    _REPLAYS[(op, impl)] = fn


def keepable_ops() -> tuple[str, ...]:
    return tuple(sorted(_KEEPABLE))


def keep_spec(op: str) -> KeepSpec | None:
    return _KEEPABLE.get(op)


def replay_of(op: str, impl: str) -> Callable | None:
    return _REPLAYS.get((op, impl), _REPLAYS.get((op, ANY)))


def current_frame():
    """The replay frame in force (`replay_frame`), or None: for the op registry, and for a keeper
    outside it (genolong.train.keep_moe keeps a whole module's output)."""
    return _FRAME.get()


@contextlib.contextmanager
def replay_frame(frame) -> Iterator[None]:
    """Put a replay frame in force for the body (genolong.train.keep: record in the forward, replay in
    the recompute). The frame has `keeps(op)`, `replaying`, `record(...)`, `replay(...)`."""
    token = _FRAME.set(frame)
    try:
        yield
    finally:
        _FRAME.reset(token)


class Reenterable:
    """A context manager made afresh by `factory()` at each entry: torch's checkpoint enters its
    recompute context once per recompute, and a graph kept with retain_graph recomputes again."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.factory = factory
        self._entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self):
        cm = self.factory()
        self._entered.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self._entered.pop().__exit__(*exc)


# True inside a checkpointed call (its forward and its recompute): what an op saves for backward
# there lives at most from the recompute to that layer's backward.
_CHECKPOINTED: contextvars.ContextVar[bool] = contextvars.ContextVar("genolong_checkpointed", default=False)


def checkpointed() -> bool:
    """Whether this call runs inside a layer checkpoint (forward or recompute). A checkpoint's forward
    drops what ops save and its recompute saves it only until the layer's backward, which follows at
    once, so an op there may save intermediates it would otherwise recompute in its own backward
    (genolong.kernels.kda.fla_chunk) without holding them for the whole step."""
    return _CHECKPOINTED.get()


@contextlib.contextmanager
def checkpointed_scope() -> Iterator[None]:
    """`checkpointed()` is true for the body."""
    token = _CHECKPOINTED.set(True)
    try:
        yield
    finally:
        _CHECKPOINTED.reset(token)
