"""One decoder layer: mHC around a sequence mixer (KDA or DSA), then mHC around an MLP (dense or MoE).

Input and output are the residual streams [B, T, n, hidden]. A DSA layer whose successor DSA
layer reuses its top-k ("shared" indexer) returns `(streams, topk)`; a shared layer takes that
top-k as a second argument. Every other layer is a plain `streams -> streams` function, which is
what the recompute and offload wrappers (genolong.train.recompute, genolong.train.offload) see.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from genolong.model.config import LAYER_KDA, MLP_MOE, ModelConfig
from genolong.model.dsa import DSAAttention
from genolong.model.kda import KimiDeltaAttention
from genolong.model.mhc import HyperConnection
from genolong.model.mlp import DenseMLP
from genolong.model.moe import MoE
from genolong.model.norms import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden, config.rms_eps
        self.layer_idx = layer_idx
        self.kind = config.layer_types[layer_idx]
        self.reuses_topk = config.reuses_topk(layer_idx)
        self.emits_topk = config.shares_topk_with_next(layer_idx)
        if self.kind == LAYER_KDA:
            self.self_attn = KimiDeltaAttention(hidden, config.kda, eps, layer_idx)
        else:
            self.self_attn = DSAAttention(hidden, config.dsa, eps, layer_idx, has_indexer=not self.reuses_topk)
        if config.mlp_types[layer_idx] == MLP_MOE:
            self.mlp = MoE(hidden, config.moe, layer_idx)
        else:
            self.mlp = DenseMLP(hidden, config.dense_mlp.intermediate_size, config.dense_mlp.swiglu_limit)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.attn_hc = HyperConnection(hidden, config.mhc, eps, layer_idx)
        self.ffn_hc = HyperConnection(hidden, config.mhc, eps, layer_idx)

    def forward(self, streams: torch.Tensor, topk: torch.Tensor | None = None):
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        if self.kind == LAYER_KDA:
            x = self.self_attn(x)
        else:
            x, topk = self.self_attn(x, topk if self.reuses_topk else None)
        streams = self.attn_hc.expand(post, comb, x, streams)

        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x))
        streams = self.ffn_hc.expand(post, comb, x, streams)
        return (streams, topk) if self.emits_topk else streams
