"""Context parallelism: one sequence split along its length over the cp ranks (docs/parallel.md).

Sharding: rank r of cp holds tokens [r * T/cp, (r + 1) * T/cp) of every sequence of the batch,
contiguous and in cp rank order. T/cp is a whole number of KDA chunks (64) and of indexer pools
(`genolong.parallel.layout.required_multiple`). Targets are shifted *before* sharding (the target
of a shard's last token is the next shard's first token), and valid masks are sharded with them.

Everything in a layer except the sequence mixers is per token and runs unchanged on the shard
(embedding, norms, mHC, MLP / MoE, the LM head and loss). `apply_context_parallel` switches each
mixer to a subclass that reaches the other shards:

- KDA (`kda_mode`, genolong/parallel/context_kda.py): "state" passes the recurrent state between
  ranks (each rank its tokens, all heads; a 3-token halo for the short conv) or "ulysses" splits
  heads (each rank gathers the whole sequence's input and runs its H/cp heads over it); "auto"
  (the default) is "ulysses" where the KDA heads divide by cp, else "state".
- DSA (genolong/parallel/context_dsa.py; the layer's own forward with a genolong/model/piece.py
  `SequencePiece`): each rank projects its own queries, latent and pooled indexer keys; the
  latent and the pooled keys are all-gathered (their gradients reduce-scattered back), the
  queries are scored against every pool (`query_offset`) and attend over the gathered latent.
  With `balance_indexer` the scoring (the one causal-triangular cost) moves in zigzag blocks
  between ranks and the int32 selections come back to their owners.

Parameters stay replicated on every cp rank; each rank's gradient is its shard's (state mode,
DSA) or its heads' share (Ulysses) of the whole, and the "grad" group's sum (the trainer's, or
`sum_gradients` here) is the single-process gradient. The loss of each rank is divided by the
valid-target count of the whole step, summed over the "loss" group (`global_valid_count`).

Like the tensor-parallel pass, modules are switched to subclasses of the model's own classes:
parameter names and state-dict keys are unchanged, and print(model) shows the classes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from genolong.errors import GenolongError
from genolong.model.dsa import DSAAttention
from genolong.model.indexer import Indexer
from genolong.model.kda import KimiDeltaAttention
from genolong.parallel.context_group import ContextGroup
from genolong.parallel.layout import check_kda_mode, resolve_kda_mode


# ---------------------------------------------------------------------------------- sharding


def shard_slice(length: int, rank: int, size: int, multiple: int = 1) -> slice:
    """Rank `rank`'s contiguous part of `length` positions; each part must be a multiple of `multiple`."""
    if length % (size * multiple):
        raise GenolongError(
            f"a sequence of {length} tokens does not split into {size} context shards of whole {multiple}-token blocks; "
            f"use a length that is a multiple of {size * multiple} (genolong.parallel.layout.required_multiple)"
        )
    part = length // size
    return slice(rank * part, (rank + 1) * part)


def shard_sequence(t: torch.Tensor, rank: int, size: int, *, dim: int = 1, multiple: int = 1) -> torch.Tensor:
    """This rank's contiguous shard of `t` along `dim` (a view)."""
    return t[(slice(None),) * dim + (shard_slice(t.shape[dim], rank, size, multiple),)]


def shard_batch(
    inputs: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, rank: int, size: int, *, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, valid) [B, T] of whole sequences, targets already shifted by one -> this
    cp rank's [B, T/cp] shards. Shifting before sharding keeps the pair (token t, target t+1)
    together even where t is a shard's last token."""
    if not (inputs.shape == targets.shape == valid.shape):
        raise GenolongError(
            f"inputs {tuple(inputs.shape)}, targets {tuple(targets.shape)} and valid {tuple(valid.shape)} must have one "
            "shape [B, T]; shift the targets by one before sharding (inputs = tokens[:, :-1], targets = tokens[:, 1:])"
        )
    return tuple(shard_sequence(t, rank, size, multiple=multiple) for t in (inputs, targets, valid))


def gather_sequence(t: torch.Tensor, group, *, dim: int = 1) -> torch.Tensor:
    """The whole sequence of a per-token result (losses, hidden states) from every rank's shard,
    without gradient: for evaluation outputs and tests."""
    size = dist.get_world_size(group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def global_valid_count(valid: torch.Tensor, group) -> torch.Tensor:
    """The number of valid targets over every rank of `group` (the trainer's "loss" group): the one
    count each rank divides its loss sum by, so a token counts once however the sequence is split."""
    count = valid.sum().to(torch.int64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def sum_gradients(model: nn.Module, group) -> None:
    """Sum every parameter's gradient over `group` in place: what the trainer's "grad" group
    reduction does for the cp dimension (each rank holds its shard's / heads' share)."""
    if dist.get_world_size(group) == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


# ---------------------------------------------------------------------------------- the pass


def apply_context_parallel(model: nn.Module, pmesh, *, kda_mode: str = "auto", balance_indexer: bool = True) -> nn.Module:
    """Split every sequence mixer of `model` over pmesh's "cp" group in place and return it.

    kda_mode: "state" (pass the recurrent state between ranks), "ulysses" (split KDA heads) or
    "auto" ("ulysses" where the KDA heads divide by cp, else "state"; print(model) shows which);
    balance_indexer: score the DSA indexer's queries in zigzag blocks (genolong/parallel/
    context_dsa.py) instead of each rank its own. Applies at any cp size (at cp=1 the collectives
    are no-ops, so the path's own overhead can be measured); a trainer calls it only when cp > 1.
    Call on every rank."""
    from genolong.parallel.context_dsa import BalancedIndexer, ContextParallelDSA
    from genolong.parallel.context_kda import ContextParallelKDA

    config = _config(model)
    check_context_parallel(config, pmesh.layout, kda_mode=kda_mode)
    if any(isinstance(m, (ContextParallelDSA, ContextParallelKDA)) for m in model.modules()):
        raise GenolongError("context parallelism is already applied to this model; apply it once, to the plain model")
    cp = ContextGroup(pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp"))
    kda_mode = resolve_kda_mode(config, cp.size, kda_mode, tp=pmesh.layout.tp)
    if pmesh.layout.tp > 1:  # the tensor-parallel pass ran first: its mixers get the tp x cp classes
        from genolong.parallel.context_tensor import switch_tensor_parallel_mixers

        switch_tensor_parallel_mixers(model, cp, kda_mode)
    for module in list(model.modules()):
        if type(module) is KimiDeltaAttention:
            module.__class__ = ContextParallelKDA
            module.cp, module.kda_mode = cp, kda_mode
        elif type(module) is DSAAttention:
            module.__class__ = ContextParallelDSA
            module.cp = cp
            if balance_indexer and type(module.indexer) is Indexer:
                module.indexer.__class__ = BalancedIndexer
                module.indexer.cp = cp
    return model


def check_context_parallel(config, layout, *, kda_mode: str = "auto") -> None:
    """Raise a one-line GenolongError if `config` (a ModelConfig) cannot run at `layout`'s cp."""
    check_kda_mode(layout, config, kda_mode)


def _config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise GenolongError("apply_context_parallel expects a GenoLongForCausalLM or GenoLongModel (a model with a .config)")
    return config
