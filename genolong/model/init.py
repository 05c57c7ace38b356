"""Initialisation for training from scratch (docs/model.md, "Initialisation").

- Linear and embedding weights, expert weights, router, mHC projections: normal(0, std) with
  std = config.initializer_range (0.02), as the reference.
- Output projections, whose results are added to the residual streams (attention and KDA
  `o_proj`, MLP / shared-expert / expert `down_proj`): normal(0, std / sqrt(2 * num_layers))
  (GPT-2 depth scaling: two residual additions per layer), so the streams' variance does not
  grow with depth at initialisation.
- The LM head: normal(0, 1 / hidden), muP's readout initialisation, where the reference uses
  std (0.02). The head reads the final RMS-normalised state h (|h| = sqrt(hidden)), so a logit
  can move by up to |W_row| |h| = std * hidden when h turns: 10 nats for glm53-mini at 0.02.
  AdamW's first steps move every weight by about lr whatever its gradient, h turns, and with
  the 8-token DNA vocabulary the result is confident wrong predictions: a loss spike at lr 1e-3
  (measurements in docs/model.md, "Initialisation"). At 1 / hidden the same turn moves a logit
  by at most 1 nat.
- Norm weights 1, biases 0.
- KDA forget gate as fla (and the reference): A_log = 0 with the bounded gate, dt_bias the
  inverse softplus of dt ~ log-uniform[1e-3, 1e-1], so the initial decay per step is mild.
- KDA short conv: PyTorch's default (kaiming-uniform), as fla's ShortConvolution; a 0.02
  normal on a 4-tap depthwise kernel would shrink q/k/v by ~25x.
- mHC as the reference: fn normal(0, std), base 0, scale 1. Every stream starts as a copy of
  the embedding and fn is small, so pre ~ 0.5, post ~ 1 and comb ~ uniform for all streams:
  the streams stay (nearly) equal and each layer acts as a plain pre-norm residual block
  (stream + f(norm(x))), i.e. the mixing starts near the identity on the common stream.
- Indexer pooling as the reference: position bias 0 and gate weights 1 (uniform-ish pooling).
- Router correction bias 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from genolong.model.dsa import DSAAttention
from genolong.model.indexer import Indexer
from genolong.model.kda import ForgetGate, KimiDeltaAttention
from genolong.model.mhc import HyperConnection
from genolong.model.mlp import DenseMLP
from genolong.model.moe import Experts, Router
from genolong.model.norms import GatedRMSNorm, RMSNorm

_OUTPUT_PROJECTIONS = (KimiDeltaAttention, DSAAttention)


@torch.no_grad()
def init_weights(model: nn.Module, *, std: float | None = None) -> None:
    """Initialise every parameter of a GenoLongForCausalLM in place (seed with torch.manual_seed)."""
    config = model.config
    std = config.initializer_range if std is None else std
    out_std = std / math.sqrt(2 * config.num_layers)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv1d):
            module.reset_parameters()
        elif isinstance(module, RMSNorm | GatedRMSNorm | nn.LayerNorm):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, 0.0, std)
            nn.init.normal_(module.down_proj, 0.0, out_std)
        elif isinstance(module, Router):
            nn.init.normal_(module.weight, 0.0, std)
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, HyperConnection):
            nn.init.normal_(module.fn, 0.0, std)
            nn.init.zeros_(module.base)
            nn.init.ones_(module.scale)
        elif isinstance(module, Indexer):
            nn.init.zeros_(module.index_kpool_compress_ape)
            nn.init.ones_(module.index_kpool_compress_gate)
    # Second pass: pieces that the generic rules above have already touched.
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        nn.init.normal_(lm_head.weight, 0.0, 1.0 / config.hidden)
    for module in model.modules():
        if isinstance(module, _OUTPUT_PROJECTIONS):
            nn.init.normal_(module.o_proj.weight, 0.0, out_std)
        elif isinstance(module, DenseMLP):
            nn.init.normal_(module.down_proj.weight, 0.0, out_std)
        elif isinstance(module, ForgetGate):
            _init_forget_gate(module)


def _init_forget_gate(gate: ForgetGate) -> None:
    if gate.lower_bound is not None:
        nn.init.zeros_(gate.A_log)
    else:
        gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1.0, 16.0).log())
    dt = torch.empty_like(gate.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
    # Inverse softplus, written stably: dt + log(1 - exp(-dt)).
    gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
