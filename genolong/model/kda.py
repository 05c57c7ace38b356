"""Kimi Delta Attention (KDA): the linear-attention mixer of 34 of GLM-5.3-Flash's 45 layers.

Per head, a [Dk, Dv] state S is decayed per key channel by exp(g_t) (g <= 0), then corrected
towards v_t along k_t with strength beta_t (the delta rule), and read out with q_t:

    S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t

q and k are L2-normalised inside the op and q is scaled by Dk^-0.5 (fla's
`use_qk_l2norm_in_kernel=True` convention, see docs/ops.md). The recurrence itself is the hot
op "kda"; `kda_reference` below is its plain-PyTorch oracle, chunked so that only one chunk's
pairwise decays exist at a time and the state stays fp32.

The module takes its head count from its weights, so a caller may slice the q/k/v/gate/output
projections to a subset of heads (Ulysses-style head split) and run it over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from genolong.model import ops
from genolong.model.config import KDAConfig
from genolong.model.norms import GatedRMSNorm

# The chunk of the reference recurrence. Its pairwise decay tensor is [C, C, Dk] per head and
# chunk, so a small chunk keeps the oracle usable at tens of thousands of tokens.
KDA_REFERENCE_CHUNK = 32
# Upper bound on the pairwise-decay elements materialised at once by the reference.
_PAIRWISE_ELEMENTS = 1 << 24


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # fla's form: divide by sqrt(sum + eps) (not max(norm, eps)); the reference matches it.
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = KDA_REFERENCE_CHUNK,
) -> torch.Tensor:
    """The "kda" op (docs/ops.md): q, k, v, g [B,T,H,D], beta [B,T,H] -> o [B,T,H,Dv] in q's dtype.

    Within a chunk of C steps, with G the in-chunk cumulative log decay, the corrections
    U = beta * (v - k^T S_pre) solve the unit lower-triangular system
    (I + diag(beta) A) U = beta V - beta (K * exp(G)) S_0, where A[i, j] = sum_d k_i k_j exp(G_i - G_j)
    for j < i. Decays only ever appear as exp(G_i - G_j) with j <= i (<= 1), so no factor can
    overflow whatever the gate values.
    """
    dtype = q.dtype
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    # fp32 at least (the state accumulates over the whole sequence); float64 stays float64.
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, g, beta = (x.to(work) for x in (q, k, v, g, beta))
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)

    pad = (-seq) % chunk_size
    if pad:
        # Padded steps have beta = 0 and g = 0: they neither change nor decay the state.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n_chunks = (seq + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.transpose(1, 2)
        return x.reshape(batch, heads, n_chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    G = g.cumsum(-2)

    device = q.device
    upto = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    before = upto.tril(-1)
    eye = torch.eye(chunk_size, device=device, dtype=work)

    # Everything that does not depend on the carried state is computed for a block of chunks at
    # once (bounded by _PAIRWISE_ELEMENTS); only three small matmuls per chunk remain sequential.
    block = max(1, _PAIRWISE_ELEMENTS // (batch * heads * chunk_size * chunk_size * dk))
    state = q.new_zeros(batch, heads, dk, dv)
    outputs = []
    for n0 in range(0, n_chunks, block):
        qn, kn, vn, Gn, bn = (x[:, :, n0 : n0 + block] for x in (q, k, v, G, beta))
        decay = (Gn.unsqueeze(-2) - Gn.unsqueeze(-3)).masked_fill(~upto[..., None], float("-inf")).exp()
        a = (kn.unsqueeze(-2) * kn.unsqueeze(-3) * decay).sum(-1).masked_fill(~before, 0.0)
        qk = (qn.unsqueeze(-2) * kn.unsqueeze(-3) * decay).sum(-1)
        system = eye + bn.unsqueeze(-1) * a
        rhs = torch.cat([bn.unsqueeze(-1) * vn, bn.unsqueeze(-1) * (kn * Gn.exp())], dim=-1)
        w, kd = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
        q_decayed = qn * Gn.exp()
        last = Gn[..., -1:, :]
        k_to_end = (kn * (last - Gn).exp()).transpose(-1, -2)
        last_decay = last.transpose(-1, -2).exp()
        for j in range(qn.shape[2]):
            u = w[:, :, j] - kd[:, :, j] @ state
            outputs.append(q_decayed[:, :, j] @ state + qk[:, :, j] @ u)
            state = last_decay[:, :, j] * state + k_to_end[:, :, j] @ u

    o = torch.stack(outputs, dim=2).reshape(batch, heads, n_chunks * chunk_size, dv)[:, :, :seq]
    return o.transpose(1, 2).to(dtype)


ops.register("kda", ops.REFERENCE, kda_reference)


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The "kda_short_conv" op (docs/ops.md): SiLU(causal depthwise conv) over x [B, T, C] with
    weight [C, W], computed in the weight's dtype (fp32), returned in x's dtype."""
    seq, width = x.shape[1], weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), padding=width - 1, groups=weight.shape[0])
    return F.silu(out[..., :seq]).transpose(1, 2).to(x.dtype)


ops.register("kda_short_conv", ops.REFERENCE, short_conv_reference)


class ForgetGate(nn.Module):
    """Per-channel log decay g <= 0 from a low-rank projection (fp32, as the reference)."""

    def __init__(self, hidden: int, cfg: KDAConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.f_a_proj = nn.Linear(hidden, cfg.head_dim, bias=False)
        self.f_b_proj = nn.Linear(cfg.head_dim, cfg.qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.qkv_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32))
        self.lower_bound = cfg.lower_bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        f = f.view(*x.shape[:-1], -1, self.head_dim)
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:
            # Bounded ("safe") gate: a scale of a sigmoid, so g lies in (lower_bound, 0).
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)


class KimiDeltaAttention(nn.Module):
    def __init__(self, hidden: int, cfg: KDAConfig, rms_eps: float, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        qkv = cfg.qkv_dim
        self.q_proj = nn.Linear(hidden, qkv, bias=False)
        self.k_proj = nn.Linear(hidden, qkv, bias=False)
        self.v_proj = nn.Linear(hidden, qkv, bias=False)
        # One depthwise causal conv over the concatenated [q; k; v] channels; weights kept fp32.
        self.conv1d = nn.Conv1d(3 * qkv, 3 * qkv, cfg.conv_kernel, groups=3 * qkv, bias=False, dtype=torch.float32)
        self.forget_gate = ForgetGate(hidden, cfg)
        self.b_proj = nn.Linear(hidden, cfg.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, cfg.head_dim, bias=False)
        self.g_b_proj = nn.Linear(cfg.head_dim, qkv, bias=False)
        self.o_norm = GatedRMSNorm(cfg.head_dim, eps=rms_eps)
        self.o_proj = nn.Linear(qkv, hidden, bias=False)

    def short_conv(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU over [B, T, C]; the hot op "kda_short_conv" (fp32 weights)."""
        return ops.call("kda_short_conv", self.layer_idx, qkv, self.conv1d.weight.squeeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = self.recurrence_inputs(x, self.short_conv(self.qkv_projections(x)))
        return self.output(x, ops.call("kda", self.layer_idx, q, k, v, g, beta))

    # The steps of forward, separate so that context parallelism (genolong/parallel/context_kda.py)
    # can put its halo exchange around the conv and pass the state between ranks.

    def qkv_projections(self, x: torch.Tensor) -> torch.Tensor:
        """The concatenated [q; k; v] projections of x [B, T, hidden], before the short conv: [B, T, 3 * qkv]."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def recurrence_inputs(self, x: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v [B,T,H,D], g [B,T,H,D], beta [B,T,H]): the "kda" op's inputs from x and the conv output qkv."""
        heads_shape = (*x.shape[:2], -1, self.head_dim)
        q, k, v = (t.reshape(heads_shape) for t in qkv.chunk(3, dim=-1))
        return q, k, v, self.forget_gate(x), torch.sigmoid(self.b_proj(x))

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The gated norm of the recurrence output o [B,T,H,Dv] and o_proj -> [B, T, hidden]."""
        batch, seq = x.shape[:2]
        gate = self.g_b_proj(self.g_a_proj(x)).view(batch, seq, -1, self.head_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(batch, seq, -1))
