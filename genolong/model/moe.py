"""Mixture of experts: sigmoid router with correction bias, normalised top-k, shared expert.

The router runs in fp32 (its weight and the correction bias are stored fp32, as in the
reference): routing decisions are discrete, and bf16 logits would flip near-ties. The correction
bias only *selects* experts; the combine weights are the unbiased sigmoid scores, normalised
over the chosen k and multiplied by `routed_scaling_factor`. The expert computation is the hot
op "moe_experts"; `moe_experts_reference` below is its oracle (tokens grouped per expert, one
GEMM pair per expert that received tokens).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from genolong.model import ops
from genolong.model.config import MoEConfig
from genolong.model.mlp import DenseMLP, clamped_swiglu


def moe_experts_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    swiglu_limit: float,
) -> torch.Tensor:
    """The "moe_experts" op (docs/ops.md): x [N,D], topk_idx/topk_w [N,k] -> y [N,D] in x's dtype."""
    n_tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0]).tolist()
    token = order // k
    weight = topk_w.reshape(-1)[order]
    y = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token[start : start + count]
        gate, up = F.linear(x[rows], gate_up_proj[expert]).chunk(2, dim=-1)
        out = F.linear(clamped_swiglu(gate, up, swiglu_limit), down_proj[expert])
        # The fp32 combine weight promotes the product; the sum is kept in x's dtype like the reference.
        y.index_add_(0, rows, (out * weight[start : start + count, None]).to(y.dtype))
        start += count
    return y


ops.register("moe_experts", ops.REFERENCE, moe_experts_reference)


class Router(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden, dtype=torch.float32))
        # Auxiliary-loss-free balancing adjusts this bias from outside; it is not trained by gradient.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (topk_idx int64 [N, k], topk_w fp32 [N, k])."""
        return route(x, self.weight, self.e_score_correction_bias, self.cfg)


def route(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's math as a function of tensors (genolong.train.compile compiles it once for every layer)."""
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + correction_bias.float()
    if cfg.n_group > 1:
        # Keep the topk_group groups whose two best experts score highest.
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, cfg.num_experts)
    topk_idx = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
    topk_w = scores.gather(1, topk_idx)
    if cfg.norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, topk_w * cfg.routed_scaling_factor


class Experts(nn.Module):
    """Routed expert weights as 3D tensors: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I]."""

    def __init__(self, hidden: int, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.swiglu_limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.expert_dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, hidden, cfg.expert_dim))

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        return ops.call(
            "moe_experts",
            self.layer_idx,
            x,
            topk_idx,
            topk_w,
            self.gate_up_proj,
            self.down_proj,
            swiglu_limit=self.swiglu_limit,
        )


class MoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.experts = Experts(hidden, cfg, layer_idx)
        self.gate = Router(hidden, cfg)
        shared = cfg.expert_dim * cfg.num_shared_experts
        self.shared_experts = DenseMLP(hidden, shared, cfg.swiglu_limit) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        topk_idx, topk_w = self.gate(flat)
        y = self.experts(flat, topk_idx, topk_w).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
