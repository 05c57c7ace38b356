"""The dense SwiGLU MLP of the first layers (and the MoE's shared expert), clamped like GLM's."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # Only the gate's upper side is clamped (silu of a large negative is already ~0).
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def swiglu_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, limit: float) -> torch.Tensor:
    """down(clamped_swiglu(gate(x), up(x))): a function of tensors, so that it can be compiled once for every layer."""
    return F.linear(clamped_swiglu(F.linear(x, gate_w), F.linear(x, up_w), limit), down_w)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.swiglu_limit)
