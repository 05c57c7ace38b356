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
        if self.kind == LAYER_KDA:
            streams = self.attention_half(streams, self.self_attn)
        else:
            found = []

            def mixer(x):
                out, chosen = self.self_attn(x, topk if self.reuses_topk else None)
                found.append(chosen)
                return out

            streams = self.attention_half(streams, mixer)
            topk = found[0]
        streams = self.mlp_half(streams)
        return (streams, topk) if self.emits_topk else streams

    # The two halves, separate so that sequence tiling (genolong/train/tiling.py) can run a tile of
    # the layer with its own mixer call (the KDA state carried in, the DSA keys of the whole sequence).

    def attention_half(self, streams: torch.Tensor, mixer) -> torch.Tensor:
        """The streams after mHC around `mixer` (a function of the normed collapsed input [B, T, hidden])."""
        post, comb, x = self.attn_hc(streams)
        return self.attn_hc.expand(post, comb, mixer(self.input_layernorm(x)), streams)

    def mixer_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What the sequence mixer reads: the collapsed, normed streams [B, T, hidden]."""
        return self.input_layernorm(self.attn_hc(streams)[2])

    def mlp_half(self, streams: torch.Tensor) -> torch.Tensor:
        """The streams after mHC around the MLP / MoE (per token)."""
        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x))
        return self.ffn_hc.expand(post, comb, x, streams)
