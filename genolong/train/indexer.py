"""Training the DSA indexer, switched on from outside the model (docs/training.md "The indexer").

The model's DSA layers carry two attributes, None by default: `indexer_loss` (an
`IndexerLossSwitch`: the layer computes its indexer's KL loss) and `recall_probe` (a
`RecallProbe`: the layer measures how much dense attention its selection keeps).
`IndexerTraining` sets them per step:

- frozen (coeff 0, the default): no switch, the indexer's parameters are not trainable and not in
  the optimizer; the model runs exactly as it did before the indexer could learn;
- warm-up (the first `warmup_steps` steps): the main model is frozen and the step runs its
  forward under no_grad with every DSA layer attending densely (all earlier keys, as in
  DeepSeek-V3.2's warm-up, so each layer's target comes from hidden states that no untrained
  selection has shaped); each DSA layer back-propagates its dense KL into its indexer during the
  forward; the optimizer updates only the indexer (`update_only`);
- sparse (after the warm-up): the KL over each query's selected pools, added to the indexer's
  gradient during the layer's backward, beside the LM loss (which never reaches the indexer);
  with `query_fraction` < 1 over a random share of the query blocks only, drawn per step and
  layer from (seed, step) (genolong.model.indexer_loss.scored_blocks).

Micro-batches: each layer's loss is the mean KL over the micro-batch's queries, weighted by
1 / grad_accum, so the step's loss is the mean over all its queries (micro-batches are equal).
"""

from __future__ import annotations

import contextlib
import math

import torch

from genolong.errors import GenolongError
from genolong.model.indexer_loss import DENSE, SPARSE, IndexerLossSwitch
from genolong.model.indexer_recall import RecallProbe

FROZEN, WARMUP, TRAINING = "frozen", "warmup", "sparse"


def indexer_layers(model) -> dict[int, torch.nn.Module]:
    """{layer index: DSAAttention} for the DSA layers that own an indexer."""
    layers = getattr(getattr(model, "model", model), "layers", [])
    return {i: layer.self_attn for i, layer in enumerate(layers) if getattr(layer.self_attn, "indexer", None) is not None}


def is_indexer_parameter(name: str) -> bool:
    return ".self_attn.indexer." in name


def trainable_parameters(model, *, train_indexer: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """The named parameters an optimizer should update. A frozen indexer's are marked
    requires_grad=False and left out (it never gets a gradient; Adam state for it would be waste)."""
    named = []
    for name, p in model.named_parameters():
        if is_indexer_parameter(name):
            p.requires_grad_(train_indexer)
            if not train_indexer:
                continue
        if p.requires_grad:
            named.append((name, p))
    return named


class IndexerTraining:
    """Which stage each step is in, the switches on the DSA layers, and the step's indexer metrics."""

    def __init__(self, model, *, coeff: float = 0.0, warmup_steps: int = 0, recall_every: int = 0, recall_queries: int = 256,
                 query_fraction: float = 1.0, seed: int = 0):
        if not (math.isfinite(coeff) and coeff >= 0):
            raise GenolongError(f"--indexer-loss-coeff must be a finite number >= 0, got {coeff}")
        if not (math.isfinite(query_fraction) and 0 < query_fraction <= 1):
            raise GenolongError(f"--indexer-loss-queries must be in (0, 1] (the share of query blocks the KL scores), got {query_fraction}")
        self.layers = indexer_layers(model)
        # Every DSA layer, shared-indexer ones too: during the warm-up all of them attend densely.
        self.dsa_layers = [layer.self_attn for layer in getattr(getattr(model, "model", model), "layers", [])
                           if hasattr(layer.self_attn, "dense_attention")]
        if (coeff > 0 or recall_every > 0) and not self.layers:
            raise GenolongError(
                "--indexer-loss-coeff / --indexer-recall-every need a model with a DSA layer that owns an indexer; "
                "this model has none (pick a preset with DSA layers, or drop the option)"
            )
        self.coeff = coeff
        self.warmup_steps = warmup_steps if coeff > 0 else 0
        self.recall_every = recall_every
        self.recall_queries = recall_queries
        self.query_fraction = query_fraction
        self.seed = seed
        self.names = {name for name, _ in model.named_parameters() if is_indexer_parameter(name)}
        self._switch: IndexerLossSwitch | None = None
        self._probe: RecallProbe | None = None
        self._phase = FROZEN

    @property
    def trains(self) -> bool:
        return self.coeff > 0

    def phase(self, step: int) -> str:
        """FROZEN, WARMUP or TRAINING for 0-based `step`."""
        if not self.trains:
            return FROZEN
        return WARMUP if step < self.warmup_steps else TRAINING

    def begin_step(self, step: int) -> str:
        self._phase = self.phase(step)
        self._switch = None
        if self._phase != FROZEN:
            self._switch = IndexerLossSwitch(DENSE if self._phase == WARMUP else SPARSE, self.coeff,
                                             query_fraction=self.query_fraction, seed=self.seed, step=step)
        self._probe = RecallProbe(self.recall_queries) if self.recall_every and step % self.recall_every == 0 else None
        for attn in self.layers.values():
            attn.indexer_loss = self._switch
            attn.recall_probe = self._probe
        for attn in self.dsa_layers:
            attn.dense_attention = self._phase == WARMUP
        return self._phase

    def micro_batch(self, weight: float) -> None:
        """This micro-batch's share of the step (1 / grad_accum)."""
        if self._switch is not None:
            self._switch.weight = weight

    def forward_context(self):
        """The warm-up runs the model forward without autograd: the main model is frozen."""
        return torch.no_grad() if self._phase == WARMUP else contextlib.nullcontext()

    def backward_lm_loss(self) -> bool:
        return self._phase != WARMUP

    def update_only(self) -> set[str] | None:
        """Parameter names the optimizer may update this step (None: all)."""
        return self.names if self._phase == WARMUP else None

    def end_step(self) -> dict:
        """The step's metrics (StepRecord's indexer fields); the layers go back to plain."""
        out: dict = {"indexer_phase": None if self._phase == FROZEN else self._phase}
        if self._switch is not None and self._switch.values:
            per_layer = {str(i): float(v) for i, v in sorted(self._switch.values.items())}
            out["indexer_loss"] = sum(per_layer.values()) / len(per_layer)
            out["indexer_loss_layers"] = per_layer
        if self._probe is not None and self._probe.values:
            per_layer = {str(i): v for i, v in sorted(self._probe.values.items())}
            out["indexer_recall"] = sum(per_layer.values()) / len(per_layer)
            out["indexer_recall_layers"] = per_layer
        self.clear()
        return out

    def clear(self) -> None:
        for attn in self.layers.values():
            attn.indexer_loss = None
            attn.recall_probe = None
        for attn in self.dsa_layers:
            attn.dense_attention = False
        self._switch = self._probe = None
        self._phase = FROZEN
