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

from genolong.model import frames, ops
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
    """The "moe_experts" op (docs/ops.md): x [N,D], topk_idx/topk_w [N,k] -> y [N,D] in x's dtype.

    The (token, expert) pairs are sorted by expert, so each expert's rows are one contiguous
    slice: one gather of the inputs, one GEMM pair per expert that received tokens, the SwiGLU
    once over all rows, and one weighted scatter-add back to the tokens.
    """
    n_tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0]).tolist()
    used = [e for e, c in enumerate(counts) if c]
    sizes = [counts[e] for e in used]
    token = order // k
    # unbind, not indexing per expert: one backward node instead of a full-size zero gradient per expert.
    gate_up, down = gate_up_proj.unbind(0), down_proj.unbind(0)
    hidden = torch.cat([F.linear(rows, gate_up[e]) for e, rows in zip(used, x[token].split(sizes))])
    gate, up = hidden.chunk(2, dim=-1)
    act = clamped_swiglu(gate, up, swiglu_limit)
    out = torch.cat([F.linear(rows, down[e]) for e, rows in zip(used, act.split(sizes))])
    # The fp32 combine weight promotes the product; the sum is kept in x's dtype like the reference.
    # Rows are in expert order, so each token's contributions are added in expert order.
    return torch.zeros_like(x).index_add_(0, token, (out * topk_w.reshape(-1)[order, None]).to(x.dtype))


ops.register("moe_experts", ops.REFERENCE, moe_experts_reference)


# The name under which a replay frame (genolong.train.keep) keeps the router's choice of experts: the
# memory pass keeps it with fp8 layer inputs, whose recompute reads a rebuilt input and would otherwise
# route some tokens to other experts than the forward whose output backward differentiates.
KEPT_ROUTE = "moe_topk"


def index_dtype(n_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds every expert index (what a kept choice is stored in)."""
    return torch.uint8 if n_experts <= 256 else torch.int16 if n_experts <= 2**15 else torch.int32


class Router(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden, dtype=torch.float32))
        # Auxiliary-loss-free balancing adjusts this bias from outside; it is not trained by gradient.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (topk_idx int64 [N, k], topk_w fp32 [N, k]). Inside a replay frame that keeps
        KEPT_ROUTE the forward records the choice and the recompute takes it: the weights are computed
        afresh from the recompute's scores at the forward's experts, so their gradient reaches the router."""
        frame = frames.current_frame() if torch.is_grad_enabled() else None
        if frame is None or not frame.keeps(KEPT_ROUTE):
            return self.route(x)
        if frame.replaying:
            chosen = frame.replay(KEPT_ROUTE, self.layer_idx, (x,))[1][0].long()
            return self.route(x, top_indices=lambda choice, k: chosen)

        # The forward picks outside autograd too: its checkpoint requires the recompute, which has no
        # top-k, to save the same tensors.
        def pick(choice: torch.Tensor, k: int) -> torch.Tensor:
            chosen = choice.detach().topk(k, dim=-1, sorted=False).indices
            frame.record(KEPT_ROUTE, self.layer_idx, "router", (x,), (chosen.to(index_dtype(self.cfg.num_experts)),))
            return chosen

        return self.route(x, top_indices=pick)

    def route(self, x: torch.Tensor, top_indices=None) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.e_score_correction_bias, self.cfg, top_indices)


def route(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor, cfg: MoEConfig,
          top_indices=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's math as a function of tensors (genolong.train.compile compiles it once for every layer).
    `top_indices(choice, k)` picks each row's k experts (default: torch.topk's indices; the compiled
    router may pass a fused kernel that picks the same ones)."""
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + correction_bias.float()
    if cfg.n_group > 1:
        # Keep the topk_group groups whose two best experts score highest.
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, cfg.num_experts)
    if top_indices is None:
        topk_idx = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
    else:
        topk_idx = top_indices(choice, cfg.top_k)
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
        self.gate = Router(hidden, cfg, layer_idx)
        shared = cfg.expert_dim * cfg.num_shared_experts
        self.shared_experts = DenseMLP(hidden, shared, cfg.swiglu_limit) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        topk_idx, topk_w = self.gate(flat)
        y = self.experts(flat, topk_idx, topk_w).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
