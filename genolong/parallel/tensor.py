"""Tensor parallelism with sequence parallelism: `apply_tensor_parallel(model, pmesh)` (docs/parallel.md).

Every tp rank of a group reads the same token ids (its cp shard of the sequence, if any). The
embedding keeps only this rank's 1/tp of the tokens, and between the sublayers each rank holds
that sequence shard of the 4 mHC streams: the mHC mixing, the norms, the router and every other
per-token step run on the shard. A mixer (KDA, DSA) or a dense MLP / shared expert

1. all-gathers its (collapsed, normed) input over tp: [B, T/tp, hidden] -> [B, T, hidden];
2. runs its column-parallel projections for this rank's heads (or MLP columns) and the per-head
   work over the whole sequence;
3. ends in its row-parallel output projection, whose partial sums are reduce-scattered back to
   sequence shards (`scatter_sum_along`).
After the last layer the final norm's output is all-gathered (`gather_along_replicated`), so
the model returns the whole sequence on every tp rank and the loss, computed identically on
each, needs nothing tp-specific (its gradient is sliced back, not summed).

The DSA indexer is *not* split by heads: its scores are summed over heads before the top-k, so
a head split would all-reduce a [T, pools] fp32 score matrix per layer. Instead each rank scores
only its own shard's queries with all indexer heads against the pooled keys of the whole
sequence (each rank pools its own shard, pool-aligned, and the [B, T/kpool, Di] keys are
all-gathered), through the op's `query_offset`, and the ranks all-gather the int32 selections:
per layer T x 2051 int32 instead of T x T/kpool fp32 scores, and no rank repeats another's
scoring.

The modules are switched to subclasses of the model's own classes (`TensorParallelKDA`, ...):
parameters keep their names (state-dict keys unchanged), the classes show in print(model), and
each forward calls the plain module's forward on the gathered input with this rank's parameter
parts (genolong.parallel.tensor_plan says which). The model code is untouched.

With cp as well, genolong.parallel.context_tensor runs the mixers on the cp shard. Not supported
yet, refused with one line: DSA o_proj biases; the DSA indexer's KL loss and recall probe (both
need the attention of all heads).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from genolong.errors import GenolongError
from genolong.model import ops
from genolong.model.config import LAYER_DSA, MLP_DENSE, MLP_MOE
from genolong.model.dsa import DSAAttention
from genolong.model.indexer import Indexer
from genolong.model.kda import KimiDeltaAttention
from genolong.model.mlp import DenseMLP
from genolong.model.model import GenoLongModel
from genolong.model.norms import RMSNorm
from genolong.model.piece import SequencePiece
from genolong.parallel.collectives import gather_along, gather_along_replicated, scatter_sum_along
from genolong.parallel.tensor_plan import ensure_reduce_groups, slice_parameters


class _TPGroup:
    """The tp group a switched module talks to (set by apply_tensor_parallel)."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def shard(self, length: int, what: str) -> slice:
        if length % self.size:
            raise GenolongError(
                f"{what}: {length} tokens do not split over {self.size} tp ranks; use a sequence length that is a multiple of {self.size} "
                "(genolong.parallel.layout.required_multiple gives the full rule)"
            )
        part = length // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def __repr__(self) -> str:
        return f"tp rank {self.rank} of {self.size}"


class SequenceShardedEmbedding(nn.Embedding):
    """Embeds only this tp rank's shard of the token ids: [B, T] -> [B, T/tp, hidden]."""

    tp: _TPGroup

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids[:, self.tp.shard(input_ids.shape[1], "the input")])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.tp}, sequence shard"


class SequenceGatheringRMSNorm(RMSNorm):
    """The final norm on the shard, then the whole sequence on every tp rank (gradient sliced back)."""

    tp: _TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_along_replicated(super().forward(x), 1, self.tp.group)

    def extra_repr(self) -> str:
        return f"{self.tp}, gathers the sequence"


class TensorParallelKDA(KimiDeltaAttention):
    """KDA on this rank's heads over the gathered sequence; o_proj's partial sums reduce-scattered."""

    tp: _TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(gather_along(x, 1, self.tp.group))
        return scatter_sum_along(out, 1, self.tp.group)

    def extra_repr(self) -> str:
        return f"{self.tp}, {self.q_proj.weight.shape[0] // self.head_dim} local heads"


class TensorParallelDSA(DSAAttention):
    """DSA on this rank's heads (q_b_proj / kv_b_proj rows, o_proj columns) over the gathered
    sequence; the latent projections and the indexer are replicated (see the module docstring)."""

    tp: _TPGroup

    def forward(self, x: torch.Tensor, topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.indexer_loss is not None or self.recall_probe is not None:
            raise GenolongError(
                f"layer {self.layer_idx}: the DSA indexer's KL loss and recall probe need the attention of every head, "
                "which tensor parallelism splits; train or probe the indexer with tp=1 (cp and ep are fine)"
            )
        out, topk = super().forward(gather_along(x, 1, self.tp.group), topk)
        return scatter_sum_along(out, 1, self.tp.group), topk

    def extra_repr(self) -> str:
        return f"{self.tp}, {self.q_b_proj.weight.shape[0] // self.qk_head_dim} local heads"


class SequenceShardedIndexer(Indexer):
    """Scores only this rank's queries (all indexer heads) against the whole sequence's pooled keys,
    then all-gathers the int32 selections (module docstring)."""

    tp: _TPGroup

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, piece: SequencePiece | None = None) -> torch.Tensor:
        """`piece`: x is a cp shard (tp with cp, genolong.parallel.context_tensor): the pooled keys
        are gathered over tp, then over cp, and the selections are global positions."""
        mine = self.tp.shard(x.shape[1], f"layer {self.layer_idx} indexer")
        if (mine.stop - mine.start) % self.cfg.kpool:
            raise GenolongError(
                f"layer {self.layer_idx}: a tp shard of {mine.stop - mine.start} tokens cuts an indexer pool of {self.cfg.kpool}; "
                "use a sequence length that genolong.parallel.layout.required_multiple accepts"
            )
        pool_keys = gather_along(self.pool_keys(x[:, mine]), 1, self.tp.group)
        if piece is not None:
            pool_keys = piece.gather(pool_keys)
        index_q, head_weights = self.queries(x[:, mine], q_resid[:, mine])
        selected = ops.call(
            "dsa_indexer_topk",
            self.layer_idx,
            index_q,
            pool_keys,
            head_weights,
            kpool=self.cfg.kpool,
            topk_pools=self.cfg.topk_pools,
            always_select_tail=self.cfg.always_select_tail,
            softmax_scale=self.softmax_scale,
            query_offset=mine.start + (0 if piece is None else piece.offset),
        )
        return gather_along(selected, 1, self.tp.group)

    def extra_repr(self) -> str:
        return f"{self.tp}, scores its shard's queries"


class TensorParallelMLP(DenseMLP):
    """SwiGLU on this rank's columns over the gathered tokens; down_proj's partial sums reduce-scattered.
    Works on [B, T/tp, hidden] and on the MoE's flattened [N, hidden] chunks alike (the token dim is -2)."""

    tp: _TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.dim() - 2
        out = super().forward(gather_along(x, dim, self.tp.group))
        return scatter_sum_along(out, dim, self.tp.group)

    def extra_repr(self) -> str:
        return f"{self.tp}, {self.gate_proj.weight.shape[0]} local columns"


_SWITCHES = (
    (KimiDeltaAttention, TensorParallelKDA),
    (DSAAttention, TensorParallelDSA),
    (Indexer, SequenceShardedIndexer),
    (DenseMLP, TensorParallelMLP),
)


def apply_tensor_parallel(model: nn.Module, pmesh) -> nn.Module:
    """Split `model` (a GenoLongForCausalLM or GenoLongModel, on any device including meta) over
    pmesh's "tp" group in place and return it; a no-op at tp=1. Collective: call on every rank."""
    size = pmesh.size("tp")
    if size == 1:
        return model
    body = _body(model)
    if any(isinstance(m, SequenceShardedEmbedding) for m in model.modules()):
        raise GenolongError("tensor parallelism is already applied to this model; apply it once, to the plain model")
    check_tensor_parallel(body.config, pmesh.layout)
    ensure_reduce_groups(pmesh)
    tp = _TPGroup(pmesh.group("tp"), pmesh.rank("tp"), size)
    slice_parameters(model, "tp", tp.rank, tp.size)
    for module in list(model.modules()):
        for plain, parallel in _SWITCHES:
            if type(module) is plain:
                _switch(module, parallel, tp)
    _switch(body.embed_tokens, SequenceShardedEmbedding, tp)
    _switch(body.norm, SequenceGatheringRMSNorm, tp)
    return model


def _switch(module: nn.Module, cls: type, tp: _TPGroup) -> None:
    module.__class__ = cls
    module.tp = tp


def _body(model: nn.Module) -> GenoLongModel:
    bodies = [m for m in model.modules() if isinstance(m, GenoLongModel)]
    if len(bodies) != 1:
        raise GenolongError("apply_tensor_parallel expects one GenoLongForCausalLM / GenoLongModel; got a model without one")
    return bodies[0]


def check_tensor_parallel(config, layout) -> None:
    """Raise a one-line GenolongError if `config` (a ModelConfig) cannot run at `layout`'s tp."""
    if layout.tp == 1:
        return
    for what, heads in (("KDA", config.kda.num_heads), ("DSA", config.dsa.num_heads)):
        if heads % layout.tp:
            raise GenolongError(f"--parallel tp={layout.tp}: the model's {heads} {what} heads do not split evenly; use a tp that divides {heads}")
    widths = [("dense MLP", config.dense_mlp.intermediate_size, MLP_DENSE)]
    widths.append(("shared expert", config.moe.expert_dim * config.moe.num_shared_experts, MLP_MOE))
    for what, width, kind in widths:
        if kind in config.mlp_types and width % layout.tp:
            raise GenolongError(f"--parallel tp={layout.tp}: the {what}'s {width} columns do not split evenly; use a tp that divides {width}")
    if LAYER_DSA in config.layer_types and config.dsa.attention_bias:
        raise GenolongError("tensor parallelism of DSA layers with attention_bias is not supported (o_proj's bias would be added tp times); use tp=1")
