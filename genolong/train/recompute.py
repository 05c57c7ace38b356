"""Full-layer activation recompute, applied from outside the model (the original recipe's full-layer recompute).

mHC keeps four residual streams, so a layer's saved activations are ~4x a plain transformer's and
selective recompute only reached ~32k tokens in the seed run; recomputing whole layers reached
~256k for ~6% more step time. The pass `apply_recompute(model)` wraps every decoder layer in
`Recompute` (print(model) shows it; state-dict keys are unchanged, genolong.train.wrapper), which
runs the layer under torch's *non-reentrant* checkpoint, so a layer keeps only its input
`[B, T, 4, hidden]` and recomputes everything else during backward. Non-reentrant because it
composes with `torch.autograd.grad`, with inputs that do not require grad, and with saved-tensor
hooks (the `Offload` wrapper sits around exactly this call, see genolong.train.offload). The
recompute runs under the kernel policy the forward ran under (genolong.model.ops.recompute_context),
and with a `keep` it takes the DSA layers' selections and sparse attention from the forward
instead of computing them again (genolong.train.keep).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.checkpoint import checkpoint

from genolong.model import ops
from genolong.train.wrapper import ModuleWrapper, wrap


def checkpointed(fn, *args, preserve_rng_state: bool = True, keep=None, **kwargs):
    """`fn(*args, **kwargs)` under a non-reentrant checkpoint whose recompute keeps the forward's kernel
    policy; `keep` (a genolong.train.keep.KeptResults): the recompute replays the kept ops' results."""
    context_fn = ops.recompute_context if keep is None else keep.context_fn
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, context_fn=context_fn, **kwargs)


class Recompute(ModuleWrapper):
    """Runs the wrapped layer checkpointed when autograd records (in evaluation there is nothing to save).

    preserve_rng_state: replay the RNG during recompute (needed only if a layer draws random
    numbers; kept on by default because a wrong replay would be a silent gradient error).
    """

    def __init__(self, module: torch.nn.Module, preserve_rng_state: bool = True, keep=None) -> None:
        super().__init__(module)
        self.preserve_rng_state = preserve_rng_state
        # genolong.train.keep.KeptResults, set by the memory pass: the DSA selections and sparse
        # attention are kept from the forward for the recompute (None: everything is recomputed).
        self.keep = keep
        self.calls = 0  # checkpointed calls; tests use it to see the wrapper is really in the loop

    def forward(self, hidden_streams: torch.Tensor, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.wrapped(hidden_streams, *args, **kwargs)
        self.calls += 1
        return checkpointed(self.wrapped, hidden_streams, *args, preserve_rng_state=self.preserve_rng_state, keep=self.keep, **kwargs)

    def extra_repr(self) -> str:
        parts = [] if self.preserve_rng_state else ["preserve_rng_state=False"]
        if self.keep is not None:
            parts.append(f"keeps {', '.join(sorted(self.keep.ops))} ({self.keep.where})")
        return ", ".join(parts)


def apply_recompute(model: torch.nn.Module, layers: Iterable[int] | None = None) -> list[Recompute]:
    """Wrap the decoder layers `layers` (None: all) of `model` in Recompute; returns the wrappers."""
    body = decoder_body(model)
    chosen = range(len(body.layers)) if layers is None else layers
    return [wrap(body.layers, str(i), Recompute) for i in chosen]


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The GenoLongModel (the module with the layer loop) inside `model`."""
    from genolong.model.model import GenoLongModel

    bodies = [m for m in model.modules() if isinstance(m, GenoLongModel)]
    if len(bodies) != 1:
        raise ValueError(f"expected a model with one GenoLongModel, found {len(bodies)}")
    return bodies[0]
