"""Which implementation each hot op runs: chosen from outside the model, recorded per layer.

The seed run's worst bug was silent: the fused sparse-attention kernel declined GLM's shapes,
the layer fell back to dense attention, and nothing said so until memory ran out. Here every
hot op of the model (DSA sparse attention, the indexer's top-k, the KDA recurrence, the MoE
experts) is called through `call(op, layer_idx, ...)`, which

- runs the implementation the *policy in force* asks for,
- records `(layer_idx, op) -> implementation` in that policy's audit (the run log prints it), and
- under the "fused" policy raises `KernelFallbackError` at the first layer whose fused kernel
  is missing or declines its inputs, instead of quietly running the reference.

Reference implementations are plain PyTorch in genolong/model (they run anywhere, they are the
oracles for the kernels' tests). genolong/kernels registers the fused ones on import. A fused
implementation that cannot handle its inputs raises `KernelUnsupported(reason)`; it never
returns None. The registry of implementations is the only process-wide state here.

Policies: "reference" (always the reference), "fused" (fused or fail loudly), "auto" (fused
where it runs, reference elsewhere, both recorded). A `KernelPolicy` object is a policy with its
own audit, and it is never process-global. It is in force

- for a model: `genolong.model.model.bind_kernel_policy(model, "fused")` (the kernel-policy pass,
  genolong.train.passes) stores it as `GenoLongModel.kernel_policy` (print(model) shows it), and
  the model's forward puts it in force for its layers. The recompute of a layer during backward
  runs under the policy that was in force when the layer ran forward (`recompute_context`, used
  by every checkpoint of the training passes), and ops that run inside backward capture the
  policy at forward (`active()`), so backward threads see the same policy as forward.
- for a context: `with policy("auto") as p:` (a contextvar: this thread or asyncio task only);
  `use(name)` sets the current context's policy (scripts). A model's own policy wins over the
  context's; a model without one runs under the caller's.
Without either, a context gets its own "reference" policy on first use.

Replay frames (genolong.model.frames, opened by genolong.train.keep around a checkpointed layer): a
keepable op's result is recorded in the forward and handed back to the recompute (docs/ops.md).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from genolong.errors import GenolongError
from genolong.model import frames

POLICIES = ("reference", "fused", "auto")
REFERENCE = "reference"


class KernelUnsupported(Exception):
    """Raised by a fused implementation that cannot run these inputs (the reason says why)."""


class KernelFallbackError(GenolongError, RuntimeError):
    """Under the "fused" policy, a layer would have run a reference path. A GenolongError: the user
    picks the policy, so the CLI reports it in one line (with the flag that changes it)."""


def _check(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"kernel policy must be one of {POLICIES}, got {name!r}")
    return name


class KernelPolicy:
    """A policy name and the audit of what ran under it: {(layer_idx, op): implementation}."""

    def __init__(self, name: str = REFERENCE) -> None:
        self.name = _check(name)
        self.audit: dict[tuple[int, str], str] = {}

    def reset_audit(self) -> None:
        self.audit = {}

    def audit_summary(self) -> dict[str, dict[str, int]]:
        """{op: {implementation: number of layers}} for the run log."""
        summary: dict[str, dict[str, int]] = {}
        for (_, op), impl in sorted(self.audit.items()):
            summary.setdefault(op, {}).setdefault(impl, 0)
            summary[op][impl] += 1
        return summary

    def call(self, op: str, layer_idx: int, *args, **kwargs):
        """Run `op` for layer `layer_idx` under this policy (see the module docstring). Inside a
        replay frame (`frames.replay_frame`) a keepable op's result is recorded, or replayed."""
        frame = frames.current_frame()
        spec = frames.keep_spec(op) if frame is not None and frame.keeps(op) else None
        if spec is None:
            return self._run(op, layer_idx, lambda name, fn: fn(*args, **kwargs))
        if frame.replaying:
            impl, kept = frame.replay(op, layer_idx, args)
            if kept is None:  # the forward's implementation cannot be replayed: it runs again
                return self._run(op, layer_idx, lambda name, fn: fn(*args, **kwargs))
            self.audit[(layer_idx, op)] = impl
            return frames.replay_of(op, impl)(kept, *args, **kwargs)

        def record(name: str, fn: Callable):
            replay = frames.replay_of(op, name)
            if replay is None:
                out = fn(*args, **kwargs)
                frame.record(op, layer_idx, name, args, None)
                return out
            # The forward's result comes out of the replay too: the checkpoint requires the
            # recompute to save the same tensors as the forward, so both save what the replay saves.
            with torch.no_grad():
                kept = spec.kept(fn(*args, **{**kwargs, **spec.record_kwargs}), kwargs)
            out = replay(kept, *args, **kwargs)
            frame.record(op, layer_idx, name, args, kept)  # (after the replay: nothing recorded if it raised)
            return out

        return self._run(op, layer_idx, record)

    def _run(self, op: str, layer_idx: int, run: Callable[[str, Callable], object]):
        """`run(name, fn)` for the implementation of `op` this policy picks (module docstring)."""
        impls = _IMPLS.get(op)
        if not impls or REFERENCE not in impls:
            raise KeyError(f"op {op!r} has no reference implementation registered")
        if self.name != REFERENCE:
            reasons = []
            for name, fn in impls.items():
                if name == REFERENCE:
                    continue
                try:
                    out = run(name, fn)
                except KernelUnsupported as why:
                    reasons.append(f"{name}: {why}")
                    continue
                self.audit[(layer_idx, op)] = name
                return out
            if self.name == "fused":
                detail = "; ".join(reasons) if reasons else "no fused implementation is registered (genolong.kernels not loaded?)"
                raise KernelFallbackError(
                    f"layer {layer_idx}: op {op!r} would fall back to the PyTorch reference ({detail}); "
                    "install the GPU kernels (the gpu extra) or choose the policy explicitly: --kernels auto (fall back, "
                    "audited) or --kernels reference"
                )
        self.audit[(layer_idx, op)] = REFERENCE
        return run(REFERENCE, impls[REFERENCE])

    def __repr__(self) -> str:
        return f"KernelPolicy({self.name!r})"


_IMPLS: dict[str, dict[str, Callable]] = {}
_ACTIVE: contextvars.ContextVar[KernelPolicy | None] = contextvars.ContextVar("genolong_kernel_policy", default=None)


def register(op: str, impl: str, fn: Callable) -> None:
    """Register `fn` as implementation `impl` of `op` (impl "reference" is the oracle)."""
    _IMPLS.setdefault(op, {})[impl] = fn


def unregister(op: str, impl: str | None = None) -> None:
    """Forget implementation `impl` of `op`, or every one (tests that register throw-away ones)."""
    if impl is None:
        _IMPLS.pop(op, None)
    else:
        _IMPLS.get(op, {}).pop(impl, None)


def implementations(op: str) -> dict[str, Callable]:
    return dict(_IMPLS.get(op, {}))


def active() -> KernelPolicy:
    """The policy in force in this context (created as "reference" on first use)."""
    current = _ACTIVE.get()
    if current is None:
        current = KernelPolicy(REFERENCE)
        _ACTIVE.set(current)
    return current


@contextlib.contextmanager
def policy(which: str | KernelPolicy) -> Iterator[KernelPolicy]:
    """Put a policy in force for the body: a name (a fresh policy, its own audit) or a KernelPolicy."""
    chosen = which if isinstance(which, KernelPolicy) else KernelPolicy(which)
    token = _ACTIVE.set(chosen)
    try:
        yield chosen
    finally:
        _ACTIVE.reset(token)


def scoped(chosen: KernelPolicy | None) -> contextlib.AbstractContextManager:
    """`policy(chosen)`, or nothing when `chosen` is None (a model without a policy of its own)."""
    return policy(chosen) if chosen is not None else contextlib.nullcontext()


def use(name: str) -> KernelPolicy:
    """Set the current context's policy by name, keeping its audit (scripts; a model's own policy wins)."""
    current = active()
    current.name = _check(name)
    return current


def current_policy() -> str:
    return active().name


def reset_audit() -> None:
    active().reset_audit()


def audit() -> dict[tuple[int, str], str]:
    """What ran under the current context's policy since its last reset: {(layer_idx, op): implementation}."""
    return dict(active().audit)


def audit_summary() -> dict[str, dict[str, int]]:
    return active().audit_summary()


def call(op: str, layer_idx: int, *args, **kwargs):
    """Run `op` for layer `layer_idx` under the policy in force (module docstring)."""
    return active().call(op, layer_idx, *args, **kwargs)


@contextlib.contextmanager
def _checkpointed_scope(chosen: KernelPolicy | None) -> Iterator[None]:
    with frames.checkpointed_scope(), scoped(chosen):
        yield


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for torch.utils.checkpoint: the recompute in backward (another thread on CUDA,
    where this context's variables are unset) runs under the policy in force at forward; both
    run with `frames.checkpointed()` true."""
    chosen = active()
    return _checkpointed_scope(None), frames.Reenterable(lambda: _checkpointed_scope(chosen))
