"""Expert load balancing, applied from outside the model (docs/training.md, "Expert balance").

Two mechanisms from DeepSeek-V3 (section 2.1.2), both attached through forward hooks on each MoE
layer's `Router`, so the model and its state-dict keys are untouched:

- **Auxiliary-loss-free balancing** (`rate`, default 1e-3 as DeepSeek-V3): the hooks count the
  tokens each expert receives during the step's forward passes; after the optimizer step every
  router's `e_score_correction_bias` moves by `rate * sign(mean load - load)`: overloaded experts
  become less likely to be chosen, underloaded ones more. The bias only *selects* experts (the
  combine weights stay the unbiased scores), it is a buffer, not a parameter, and it is saved
  with the model, so a resumed run continues with it.
- **Sequence-wise balance loss** (`aux_loss_coeff`, DeepSeek-V3 eq. 17-20, off by default):
  per sequence and MoE layer, `coeff * sum_i f_i * P_i` with `f_i = E / (K T) * (tokens routed
  to expert i)` and `P_i` the mean over the sequence of expert i's affinity normalised over all
  experts. Its gradient joins the LM loss's backward through `_AuxLossGradient` (the router's
  combine weights carry it, as megatron's MoEAuxLossAutoScaler does), so it needs no second
  backward and works under recompute.

Counting each token once: under full-layer recompute (non-reentrant checkpoint) and MoE chunking
the router runs again inside backward. Those recomputations happen while autograd executes a
graph task, so `torch._C._current_graph_task_id() != -1` tells them apart; they build the same
aux-loss graph (checkpoint needs the recomputation to save what the forward saved) but do not
count. Expert loads are reported per MoE layer as max / mean and min / mean tokens per expert;
the MoE has no capacity limit, so no token is ever dropped and there is nothing else to report.

Sequence tiling (genolong/train/tiling.py): the router sees one tile of every sequence at a time;
the loss is still each whole sequence's (`_tile_aux`), its counts gathered over the tiles.

Data parallelism: `update(reduce=...)` takes a function that sums the stacked counts over the
replicas (e.g. an all-reduce) so that every replica applies the same bias change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from genolong.errors import GenolongError
from genolong.train.tiling import current_tile


@dataclass
class BalanceStats:
    """One step's expert loads (keys: MoE layer index) and the balance loss added to the LM loss."""

    load_max: dict[int, float]  # max over experts of tokens received / mean tokens per expert
    load_min: dict[int, float]  # min over experts / mean
    aux_loss: float | None  # the step's total balance loss (all layers), None when it is off


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the router's combine weights whose backward also starts the balance loss's.

    The balance loss is not part of the returned LM loss, so `loss.backward()` alone would never
    differentiate it; tying its gradient (1, the loss already carries its coefficient) to the
    combine weights, which every backward through the MoE reaches, adds it in the same pass.
    """

    @staticmethod
    def forward(ctx, topk_w: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        return topk_w.view_as(topk_w)

    @staticmethod
    def backward(ctx, grad_w: torch.Tensor):
        return grad_w, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class _TiledBalanceLoss(torch.autograd.Function):
    """scale * sum(counts * affinity) for a tile's summed affinities [B, E], whose gradient reads
    `counts` [B, E] (the sequences' whole routing counts) when backward runs: by then every tile of
    the layer's forward has added its tokens (a plain product would save the counts half-filled)."""

    @staticmethod
    def forward(ctx, affinity: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.counts, ctx.scale = counts, scale
        return scale * (counts.float() * affinity).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale * ctx.counts.float(), None, None


def sequence_balance_loss(
    scores: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, segment_tokens: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without its coefficient, summed over segments.

    scores: [N, E] sigmoid affinities (differentiable); topk_idx: [N, K] the experts chosen.
    The N tokens are cut into consecutive segments of `segment_tokens` (the last may be shorter);
    each segment s adds (n_s / N) * sum_i f_i P_i, so the result is the token-weighted mean of
    the per-segment losses. A perfectly balanced segment gives 1.
    """
    n, k = topk_idx.shape
    total = scores.new_zeros((), dtype=torch.float32)
    for start in range(0, n, segment_tokens):
        seg_scores = scores[start : start + segment_tokens].float()
        seg_idx = topk_idx[start : start + segment_tokens]
        t = seg_scores.shape[0]
        counts = _expert_counts(seg_idx, num_experts).to(torch.float32)
        f = counts * (num_experts / (k * t))
        p = (seg_scores / seg_scores.sum(dim=-1, keepdim=True)).mean(dim=0)
        total = total + (t / n) * (f * p).sum()
    return total


def _expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E] tokens per expert; scatter_add rather than bincount, which syncs with a CUDA host."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _in_backward() -> bool:
    """True while autograd runs a backward pass (where recompute replays the forward)."""
    return torch._C._current_graph_task_id() != -1


class ExpertBalancer:
    """Counts routed tokens per expert per MoE layer, updates the correction biases, adds the balance loss.

    Per step: `begin_step(tokens, sequence_tokens)` before the forward passes, the forward and
    backward passes, then `finish_step(update_bias)` after the optimizer step; it returns the
    step's `BalanceStats` (None for a model without MoE layers).
    """

    def __init__(self, model: torch.nn.Module, *, rate: float = 1e-3, aux_loss_coeff: float = 0.0) -> None:
        from genolong.model.moe import MoE

        if rate < 0 or aux_loss_coeff < 0:
            raise GenolongError(f"--balance-rate and --aux-loss-coeff must be >= 0, got {rate} and {aux_loss_coeff}")
        self.rate = float(rate)
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.routers = {m.experts.layer_idx: m.gate for m in model.modules() if isinstance(m, MoE)}
        self.counts = {i: torch.zeros(r.cfg.num_experts, dtype=torch.int64, device=r.weight.device) for i, r in self.routers.items()}
        self._aux_parts: list[torch.Tensor] = []
        self._step_tokens = 0
        self._sequence_tokens = 0
        self._hooks = [r.register_forward_hook(functools.partial(self._on_route, i)) for i, r in self.routers.items()]

    def begin_step(self, step_tokens: int, sequence_tokens: int) -> None:
        """`step_tokens`: input tokens of the whole optimizer step (all micro-batches), which the
        balance loss is normalised by; `sequence_tokens`: tokens of one sequence (its segment)."""
        self._step_tokens = int(step_tokens)
        self._sequence_tokens = int(sequence_tokens)
        for counts in self.counts.values():
            counts.zero_()
        self._aux_parts = []

    def _on_route(self, layer_idx: int, router: torch.nn.Module, inputs: tuple, output: tuple):
        topk_idx, topk_w = output
        replay = _in_backward()
        if not replay:
            self.counts[layer_idx] += _expert_counts(topk_idx, router.cfg.num_experts)
        if self.aux_loss_coeff == 0 or not torch.is_grad_enabled():
            return None
        x = inputs[0]
        scores = torch.sigmoid(torch.nn.functional.linear(x.float(), router.weight.float()))
        tile = current_tile()
        if tile is not None:
            return topk_idx, _AuxLossGradient.apply(topk_w, self._tile_aux(layer_idx, router, tile, scores, topk_idx, replay))
        n = x.shape[0]
        segment = min(self._sequence_tokens or n, n)
        # The call holds n of the step's tokens: its share of the step's token-weighted mean.
        share = n / (self._step_tokens or n)
        aux = self.aux_loss_coeff * share * sequence_balance_loss(scores, topk_idx, router.cfg.num_experts, segment)
        if not replay:
            self._aux_parts.append(aux.detach())
        return topk_idx, _AuxLossGradient.apply(topk_w, aux)

    def _tile_aux(self, layer_idx: int, router, tile, scores: torch.Tensor, topk_idx: torch.Tensor, replay: bool):
        """The balance loss of one sequence tile (genolong/train/tiling.py), exact for the whole
        sequences: the loss is coeff / step_tokens * sum over sequences s and experts i of
        f_si * (sum over s's tokens of the normalised affinity), with f_si from s's *whole* routing
        counts. The tiles' counts accumulate in the layer call's state during the forward; the
        gradient, taken in backward, reads them complete; the logged value is summed at finish_step."""
        batch, seq = tile.call.batch, tile.call.seq_len
        num_experts, k = router.cfg.num_experts, topk_idx.shape[-1]
        counts = tile.call.counts.get(layer_idx)
        if counts is None:
            counts = tile.call.counts[layer_idx] = torch.zeros(batch, num_experts, dtype=torch.int64, device=scores.device)
        if not replay:
            flat = topk_idx.reshape(batch, -1)
            counts.scatter_add_(1, flat, torch.ones_like(flat))
        affinity = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, -1, num_experts).sum(dim=1)
        scale = self.aux_loss_coeff * num_experts / (k * seq * (self._step_tokens or batch * seq))
        if not replay:
            summed = affinity.detach()
            self._aux_parts.append(lambda: scale * (counts.float() * summed).sum())
        return _TiledBalanceLoss.apply(affinity, counts, scale)

    @torch.no_grad()
    def finish_step(self, update_bias: bool = True, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> BalanceStats | None:
        """After the optimizer step: the step's loads, and (when `update_bias` and rate > 0) the
        bias update. `reduce` sums the stacked [layers, E] counts over data-parallel replicas."""
        if not self.routers:
            return None
        layers = sorted(self.routers)
        loads = torch.stack([self.counts[i].to(torch.float32) for i in layers])
        if reduce is not None:
            loads = reduce(loads)
        mean = loads.mean(dim=-1, keepdim=True)
        if update_bias and self.rate > 0 and bool((mean > 0).all()):
            for row, i in enumerate(layers):
                bias = self.routers[i].e_score_correction_bias
                bias.add_(self.rate * torch.sign(mean[row] - loads[row]).to(bias.device, bias.dtype))
        ratio = (loads / mean.clamp_min(1e-12)).cpu()
        aux = None
        if self.aux_loss_coeff > 0:
            parts = [p() if callable(p) else p for p in self._aux_parts]
            mine = torch.stack(parts).sum().reshape(1) if parts else torch.zeros(1)
            # Each rank holds its own sequences' share of the step's loss: the step's is their sum.
            aux = float(reduce(mine.to(loads.device, torch.float32)) if reduce is not None else mine)
        return BalanceStats(
            load_max={i: float(ratio[row].max()) for row, i in enumerate(layers)},
            load_min={i: float(ratio[row].min()) for row, i in enumerate(layers)},
            aux_loss=aux,
        )

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
