"""Full-layer activation recompute, applied from outside the model (seed optimization 4).

mHC keeps four residual streams, so a layer's saved activations are ~4x a plain transformer's and
selective recompute only reached ~32k tokens in the seed run; recomputing whole layers reached
~256k for ~6% more step time. `LayerRunner` is the model's `layer_runner` hook
(`GenoLongModel.layer_runner(layer_idx, layer, hidden_streams)`): it runs each layer under
torch's *non-reentrant* checkpoint, so a layer keeps only its input `[B, T, 4, hidden]` and
recomputes everything else during backward. Non-reentrant because it composes with
`torch.autograd.grad`, with inputs that do not require grad, and with saved-tensor hooks (the
offloader wraps exactly this call, see genolong.train.offload). Module parameters and state-dict
keys are untouched: the runner is an attribute of the model, not a wrapper around its layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch.utils.checkpoint import checkpoint

from genolong.train.offload import HostOffloader


class LayerRunner:
    """Runs one decoder layer: checkpointed if it recomputes, inside the offload hooks if it offloads.

    recompute_layers: which layer indices recompute (None: all).
    offloader: parks each recomputed layer's input in host memory (None: keep it on the device).
    preserve_rng_state: replay the RNG during recompute (needed only if a layer draws random
    numbers; kept on by default because a wrong replay would be a silent gradient error).
    """

    def __init__(
        self,
        recompute_layers: Iterable[int] | None = None,
        offloader: HostOffloader | None = None,
        preserve_rng_state: bool = True,
    ) -> None:
        self.recompute_layers = None if recompute_layers is None else frozenset(recompute_layers)
        self.offloader = offloader
        self.preserve_rng_state = preserve_rng_state
        self.calls = 0  # checkpointed layer calls; tests use it to see the runner is really in the loop

    def recomputes(self, layer_idx: int) -> bool:
        return self.recompute_layers is None or layer_idx in self.recompute_layers

    def __call__(self, layer_idx: int, layer: torch.nn.Module, hidden_streams: torch.Tensor, *args, **kwargs):
        # Without autograd (evaluation) there is nothing to save, so nothing to recompute.
        if not torch.is_grad_enabled() or not self.recomputes(layer_idx):
            return layer(hidden_streams, *args, **kwargs)
        self.calls += 1
        hooks = self.offloader.hooks(layer_idx) if self.offloader is not None else contextlib.nullcontext()
        with hooks:
            return checkpoint(
                layer,
                hidden_streams,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                **kwargs,
            )
