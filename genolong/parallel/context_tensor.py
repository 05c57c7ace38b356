"""Tensor parallelism together with context parallelism: the mixers of a tp-split model on a cp shard.

The mesh puts tp innermost (genolong.parallel.mesh), and the tensor-parallel embedding cuts each
cp shard into tp parts, so rank (cp r, tp t) holds tokens [(r tp + t) T/(cp tp), ...): between
the sublayers the ranks of the flattened cp x tp group hold contiguous pieces of the sequence, in
order, and everything per token (mHC, norms, MLP / MoE, the loss) runs on them unchanged. Only
the mixers see more than their own tokens. Each first all-gathers its input over tp, as under tp
alone, which gives it its cp shard [B, T/cp, hidden] with this rank's heads' parameters; the cp
mechanism then runs on those heads over the shard, among the cp ranks of the same tp rank (the
mesh's "cp" group: same heads, other shards); the output is reduce-scattered over tp.

- KDA (`TensorContextParallelKDA`): state passing carries each local head's recurrent state
  between cp ranks; Ulysses splits the H/tp local heads again over cp (they must divide:
  genolong.parallel.layout.check_kda_mode), using the same per-head table on the tp part.
- DSA (`TensorContextParallelDSA`): the layer's own forward on the cp shard with a
  `SequencePiece`; the latent (replicated over tp) is gathered over cp; the indexer stays the
  tensor-parallel one (`SequenceShardedIndexer`: each rank scores its tp part of the shard's
  queries against the pooled keys gathered over tp, then over cp, and the int32 selections are
  gathered over tp). Its scoring is not zigzag-balanced here: the flattened rank's work grows with
  its position as under cp with contiguous shards.

Gradients need nothing new: a tp-split parameter is summed over dp x ep x cp, a replicated one
over that and tp (genolong.parallel.tensor_plan), which is what each rank's share (its shard,
its heads, its cp head slice under Ulysses) adds up to. The indexer's KL loss and recall probe
stay refused under tp (they need the attention of every head).
"""

from __future__ import annotations

import torch

from genolong.errors import GenolongError
from genolong.model.dsa import DSAAttention
from genolong.model.kda import KimiDeltaAttention
from genolong.parallel.collectives import gather_along, scatter_sum_along
from genolong.parallel.context_group import ContextGroup
from genolong.parallel.context_kda import ContextParallelKDA
from genolong.parallel.tensor import TensorParallelDSA, TensorParallelKDA


class TensorContextParallelKDA(ContextParallelKDA):
    """KDA on this tp rank's heads over its cp shard, split further by the cp mode (module docstring)."""

    tp: object

    def forward(self, x: torch.Tensor, *, plain: bool = False) -> torch.Tensor:
        if plain:  # the Ulysses path's call on head slices of this rank's tp part
            return KimiDeltaAttention.forward(self, x)
        out = super().forward(gather_along(x, 1, self.tp.group))
        return scatter_sum_along(out, 1, self.tp.group)

    def extra_repr(self) -> str:
        return f"{self.tp}, {self.q_proj.weight.shape[0] // self.head_dim} local heads, {super().extra_repr()}"


class TensorContextParallelDSA(TensorParallelDSA):
    """DSA on this tp rank's heads: its cp shard's queries against the whole sequence's latent."""

    cp: ContextGroup

    def forward(self, x: torch.Tensor, topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.indexer_loss is not None or self.recall_probe is not None:
            return super().forward(x, topk)  # (refused there, in one line)
        shard = gather_along(x, 1, self.tp.group)
        if self.indexer is not None and shard.shape[1] % self.indexer.cfg.kpool:
            raise GenolongError(
                f"layer {self.layer_idx}: a context shard of {shard.shape[1]} tokens cuts an indexer pool of "
                f"{self.indexer.cfg.kpool}; use a sequence length that genolong.parallel.layout.required_multiple accepts"
            )
        out, topk = DSAAttention.forward(self, shard, topk, piece=self.cp.piece(shard.shape[1]))
        return scatter_sum_along(out, 1, self.tp.group), topk

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.cp}, own queries against the gathered latent and pooled keys"


def switch_tensor_parallel_mixers(model: torch.nn.Module, cp: ContextGroup, kda_mode: str) -> None:
    """Switch the tensor-parallel mixers of `model` to their tp x cp classes (module docstring)."""
    for module in list(model.modules()):
        if type(module) is TensorParallelKDA:
            module.__class__ = TensorContextParallelKDA
            module.cp, module.kda_mode = cp, kda_mode
        elif type(module) is TensorParallelDSA:
            module.__class__ = TensorContextParallelDSA
            module.cp = cp
