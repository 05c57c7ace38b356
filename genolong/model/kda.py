"""Kimi Delta Attention (KDA): the linear-attention mixer of 34 of GLM-5.3-Flash's 45 layers.

Per head, a [Dk, Dv] state S is decayed per key channel by exp(g_t) (g <= 0), then corrected
towards v_t along k_t with strength beta_t (the delta rule), and read out with q_t:

    S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t

q and k are L2-normalised inside the op and q is scaled by Dk^-0.5 (fla's
`use_qk_l2norm_in_kernel=True` convention, see docs/ops.md). The recurrence itself is the hot
op "kda"; `kda_reference` below is its plain-PyTorch oracle and the CPU path: the chunk form,
linear in length, with an fp32 (or float64) state that it can take in and hand out.

The module takes its head count from its weights, so a caller may slice the q/k/v/gate/output
projections to a subset of heads (Ulysses-style head split) and run it over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.model import ops
from genolong.model.config import KDAConfig
from genolong.model.norms import GatedRMSNorm

# Steps per chunk of the reference (a power of two). The sequential loop runs once per chunk and
# keeps one [Dk, Dv] state per chunk; the in-chunk work grows as C per position.
KDA_REFERENCE_CHUNK = 16


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
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = KDA_REFERENCE_CHUNK,
):
    """The "kda" op (docs/ops.md): q, k, v, g [B,T,H,D], beta [B,T,H] -> o [B,T,H,Dv] in q's dtype,
    or (o, final_state) when `output_final_state`. `initial_state` / `final_state`: S [B,H,Dk,Dv]
    before the first / after the last token (None = zeros), in the working precision (fp32, or
    float64 for float64 inputs).

    Chunk form (the WY representation), with G the in-chunk cumulative log decay and S the state
    at the chunk's start. The corrections u_i = beta_i (v_i - S_i^T k_i) of the chunk's steps
    solve the unit lower-triangular system (I + diag(beta) A) U = beta V - beta (K * exp(G)) S
    with A[i, j] = sum_d k_i k_j exp(G_i - G_j) for j < i; so U = W - KD S with W and KD
    independent of S. Then O = (Q * exp(G)) S + QK U, and the state after the chunk is an affine
    map of S: S' = (diag(exp(G_last)) - K_end^T KD) S + K_end^T W. Everything but that map's
    application is computed for all chunks at once; the sequential part is one [Dk, Dk] x [Dk, Dv]
    product per chunk. Decays only appear as exp(G_i - G_j) with j <= i, exp(G) and
    exp(G_last - G), all of non-positive numbers: nothing overflows whatever the gate values.
    """
    dtype = q.dtype
    batch, seq, heads, dk = k.shape
    dv = v.shape[-1]
    # fp32 at least (the state accumulates over the whole sequence); float64 stays float64.
    work = torch.promote_types(dtype, torch.float32)
    check_state(initial_state, (batch, heads, dk, dv))
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    q, k, v, g, beta = (x.to(work) for x in (q, k, v, g, beta))
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)

    pad = (-seq) % chunk_size
    if pad:
        # Padded steps have k = 0, beta = 0 and g = 0: they neither change nor decay the state.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n_chunks = (seq + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.transpose(1, 2)
        return x.reshape(batch, heads, n_chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    beta = beta.unsqueeze(-1)
    G = g.cumsum(-2)
    last = G[..., -1:, :]

    qk, kk = _decayed_scores(torch.stack([q, k]), k, G).unbind(0)
    system = torch.eye(chunk_size, dtype=work, device=q.device) + beta * kk.tril(-1)
    rhs = torch.cat([beta * v, beta * k * G.exp()], dim=-1)
    w, kd = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    k_to_end = (k * (last - G).exp()).transpose(-1, -2)
    transition = torch.diag_embed(last.squeeze(-2).exp()) - k_to_end @ kd
    starts, final_state = _carry_state(transition, k_to_end @ w, initial_state)
    u = w - kd @ starts
    o = (q * G.exp()) @ starts + qk @ u

    o = o.reshape(batch, heads, n_chunks * chunk_size, dv)[:, :, :seq].transpose(1, 2).to(dtype)
    return (o, final_state) if output_final_state else o


def _decayed_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Per chunk, S[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i, 0 for j > i:
    k, G [..., C, D] and x broadcastable to them -> [..., C, C]; C a power of two.

    By halves: the pairs inside each half recursively (both halves as one batch), the pairs across
    (j in the first half, i in the second) as one matmul through the decay at the end of the
    first half, r: exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both exponents <= 0. So
    the per-channel decays cost D per position and level (log2 C levels), and no [C, C, D]
    tensor of pairwise decays is ever formed.
    """
    chunk = G.shape[-2]
    if chunk == 1:
        return (x * k).sum(-1, keepdim=True)
    half = chunk // 2
    halves = [t.unflatten(-2, (2, half)) for t in (x, k, G)]
    first, second = _decayed_scores(*halves).unbind(-3)
    (_, x1), (k0, _), (G0, G1) = (t.unbind(-3) for t in halves)
    G_r = G0[..., -1:, :]
    cross = torch.einsum("...id,...jd->...ij", x1 * (G1 - G_r).exp(), k0 * (G_r - G0).exp())
    return torch.cat([F.pad(first, (0, half)), torch.cat([cross, second], dim=-1)], dim=-2)


def _carry_state(
    transition: torch.Tensor, fresh: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over chunks, S_{n+1} = transition_n S_n + fresh_n, from S_0 = initial_state:
    ([B, H, N, Dk, Dv] the state at each chunk's start, [B, H, Dk, Dv] the state after the last)."""
    batch, heads, n_chunks, dk, dv = fresh.shape
    if initial_state is None:
        state = fresh.new_zeros(batch * heads, dk, dv)
    else:
        state = initial_state.to(fresh.dtype).reshape(batch * heads, dk, dv)
    starts = []
    # unbind, not indexing inside the loop: one backward node for all chunks instead of a
    # full-size zero gradient per chunk (quadratic in the length).
    steps = zip(transition.flatten(0, 1).unbind(1), fresh.flatten(0, 1).unbind(1))
    for a, b in steps:
        starts.append(state)
        state = torch.baddbmm(b, a, state)
    starts = torch.stack(starts, dim=1).view(batch, heads, n_chunks, dk, dv)
    return starts, state.view(batch, heads, dk, dv)


def check_state(state: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    """The "kda" op's initial_state must be [B, H, Dk, Dv] (every implementation checks it alike)."""
    if state is not None and tuple(state.shape) != expected:
        raise GenolongError(
            f"kda initial_state has shape {list(state.shape)}, expected [B, H, Dk, Dv] = {list(expected)}; "
            "pass the final_state of the previous piece of the same sequences"
        )


ops.register("kda", ops.REFERENCE, kda_reference)


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The "kda_short_conv" op (docs/ops.md): SiLU(causal depthwise conv) over x [B, T, C] with
    weight [C, W], computed in the weight's dtype (fp32), returned in x's dtype."""
    width = weight.shape[-1]
    # Zeros on the left only, so the conv's output is exactly the T causal positions (no slice);
    # returned contiguous in [B, T, C]: a transposed view made every later op on q, k, v (norms,
    # gates, the chunked recurrence) stride across channels, several times slower on the CPU.
    padded = F.pad(x.transpose(1, 2).to(weight.dtype), (width - 1, 0))
    out = F.silu(F.conv1d(padded, weight.unsqueeze(1), groups=weight.shape[0]))
    return out.transpose(1, 2).to(x.dtype, memory_format=torch.contiguous_format)


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
