"""Which implementation each hot op runs: chosen from outside the model, recorded per layer.

The seed run's worst bug was silent: the fused sparse-attention kernel declined GLM's shapes,
the layer fell back to dense attention, and nothing said so until memory ran out. Here every
hot op of the model (DSA sparse attention, the indexer's top-k, the KDA recurrence, the MoE
experts) is called through `call(op, layer_idx, ...)`, which

- runs the implementation the current *policy* asks for,
- records `(layer_idx, op) -> implementation` in an audit that the run log prints, and
- under the "fused" policy raises `KernelFallbackError` at the first layer whose fused kernel
  is missing or declines its inputs, instead of quietly running the reference.

Reference implementations are plain PyTorch in genolong/model (they run anywhere, they are the
oracles for the kernels' tests). genolong/kernels registers the fused ones on import. A fused
implementation that cannot handle its inputs raises `KernelUnsupported(reason)`; it never
returns None.

Policies: "reference" (always the reference), "fused" (fused or fail loudly), "auto" (fused
where it runs, reference elsewhere, both recorded). The default is "reference" so that CPU
code never needs the GPU packages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

POLICIES = ("reference", "fused", "auto")
REFERENCE = "reference"


class KernelUnsupported(Exception):
    """Raised by a fused implementation that cannot run these inputs (the reason says why)."""


class KernelFallbackError(RuntimeError):
    """Under the "fused" policy, a layer would have run a reference path."""


@dataclass
class _Registry:
    impls: dict[str, dict[str, Callable]]
    policy: str = REFERENCE
    audit: dict[tuple[int, str], str] | None = None


_STATE = _Registry(impls={})


def register(op: str, impl: str, fn: Callable) -> None:
    """Register `fn` as implementation `impl` of `op` (impl "reference" is the oracle)."""
    _STATE.impls.setdefault(op, {})[impl] = fn


def implementations(op: str) -> dict[str, Callable]:
    return dict(_STATE.impls.get(op, {}))


def use(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"kernel policy must be one of {POLICIES}, got {policy!r}")
    _STATE.policy = policy


def current_policy() -> str:
    return _STATE.policy


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    previous = _STATE.policy
    use(name)
    try:
        yield
    finally:
        _STATE.policy = previous


def reset_audit() -> None:
    _STATE.audit = {}


def audit() -> dict[tuple[int, str], str]:
    """What ran since the last reset: {(layer_idx, op): implementation name}."""
    return dict(_STATE.audit or {})


def audit_summary() -> dict[str, dict[str, int]]:
    """{op: {implementation: number of layers}} for the run log."""
    summary: dict[str, dict[str, int]] = {}
    for (_, op), impl in sorted((_STATE.audit or {}).items()):
        summary.setdefault(op, {}).setdefault(impl, 0)
        summary[op][impl] += 1
    return summary


def _record(layer_idx: int, op: str, impl: str) -> None:
    if _STATE.audit is None:
        _STATE.audit = {}
    _STATE.audit[(layer_idx, op)] = impl


def call(op: str, layer_idx: int, *args, **kwargs):
    """Run `op` for layer `layer_idx` under the current policy (see the module docstring)."""
    impls = _STATE.impls.get(op)
    if not impls or REFERENCE not in impls:
        raise KeyError(f"op {op!r} has no reference implementation registered")
    if _STATE.policy != REFERENCE:
        fused = [(name, fn) for name, fn in impls.items() if name != REFERENCE]
        reasons = []
        for name, fn in fused:
            try:
                out = fn(*args, **kwargs)
            except KernelUnsupported as why:
                reasons.append(f"{name}: {why}")
                continue
            _record(layer_idx, op, name)
            return out
        if _STATE.policy == "fused":
            detail = "; ".join(reasons) if reasons else "no fused implementation is registered (genolong.kernels not loaded?)"
            raise KernelFallbackError(
                f"layer {layer_idx}: op {op!r} would fall back to the PyTorch reference ({detail}); "
                "fix the kernel or run with the 'reference' / 'auto' kernel policy explicitly"
            )
    _record(layer_idx, op, REFERENCE)
    return impls[REFERENCE](*args, **kwargs)
