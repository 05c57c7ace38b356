"""FLOPs of one training step, per layer type, for tokens/s -> MFU (docs/training.md has the table).

Conventions (matmul of [m, k] x [k, n] = 2mkn FLOPs; norms, activations, softmax, Sinkhorn and
top-k selection are not counted, they are well under 1% of the total):

- model FLOPs: what the algorithm needs. Forward once, backward twice the forward, for every
  part that has gradients. The DSA indexer has none (its top-k is not differentiable and its
  weights are frozen, docs/model.md), so it counts forward only.
- hardware FLOPs: what the GPU actually executes: model FLOPs plus the forward that full-layer
  recompute repeats in backward, plus the chunked loss head's logits recomputed in backward,
  plus one more MoE forward when MoE chunks run under their own checkpoint (moe_chunking).
  MFU uses model FLOPs; HFU uses hardware FLOPs. Recompute raises HFU, never MFU.

Per layer type, for a sequence of T tokens (h = hidden, one head's dims in the layer's config):

- KDA at its real chunked cost (fla `chunk_kda`, chunk C = 64), per token and head (d = head
  dim): intra-chunk k-k and q-k scores 2*2Cd, the triangular solve 2C^2/3, w and u 2*2Cd,
  the intra-chunk output 2Cd, and the state products (w S, q S, k^T v) 3*2d^2. Linear in T.
  Plus projections q/k/v/o, the low-rank forget and output gates, beta, and the short convs.
- DSA at its real top-k: query t attends to min(t + 1, W) keys, W = topk + kpool - 1 (2051 for
  GLM-5.3-Flash), in the absorbed latent space (score and value products over kv_lora_rank),
  plus the q/kv low-rank projections and the per-head absorb / un-absorb products.
- DSA indexer (forward only): q/k/weight projections, and scoring the causal half of the pools:
  query t scores floor((t + 1) / kpool) complete pools with n_heads x head_dim products.
- MoE at its active experts: router h x E, top_k routed + shared experts of SwiGLU 3 matmuls.
  Dense MLP layers: one SwiGLU of intermediate_size.
- mHC at each of the two sublayers: the 24 mixing logits from the flattened streams and the
  stream mixes (pre-weighting, post and comb).
- LM head: 2 h V per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from genolong.model.config import LAYER_DSA, LAYER_KDA, MLP_DENSE, MLP_MOE, ModelConfig

KDA_CHUNK = 64

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a substring of the device name.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "H800": 989.4e12,
    "B200": 2250e12,
    "A100": 312e12,
}


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one sequence of `seq_len` tokens through forward + backward."""

    model: float  # MFU numerator
    hardware: float  # HFU numerator: model + recompute + loss-head recompute
    forward: dict[str, float]  # forward FLOPs per component, for the docs and the log

    def scaled(self, sequences: int) -> StepFlops:
        return StepFlops(self.model * sequences, self.hardware * sequences, {k: v * sequences for k, v in self.forward.items()})


def _sum_min(t: int, w: int) -> int:
    """sum_{i=0}^{t-1} min(i + 1, w): keys attended to over a causal sequence capped at w."""
    if t <= w:
        return t * (t + 1) // 2
    return w * (w + 1) // 2 + (t - w) * w


def _sum_pools(t: int, kpool: int) -> int:
    """sum_{i=0}^{t-1} floor((i + 1) / kpool): complete pools visible to each query.

    Over i + 1 = 0..t: whole groups j = 0..q-1 of kpool values contribute j each, then the r + 1
    values q*kpool..t contribute q each (t = q*kpool + r).
    """
    q, r = divmod(t, kpool)
    return kpool * q * (q - 1) // 2 + q * (r + 1)


def kda_forward(config: ModelConfig, t: int) -> float:
    h, k = config.hidden, config.kda
    n, d, qkv = k.num_heads, k.head_dim, k.qkv_dim
    proj = 2 * h * qkv * 4  # q, k, v, o
    gates = 2 * (h * d + d * qkv) * 2 + 2 * h * n  # low-rank forget and output gates, beta
    conv = 2 * qkv * k.conv_kernel * 3
    c = KDA_CHUNK
    core = n * (10 * c * d + 2 * c * c / 3 + 6 * d * d)
    return t * (proj + gates + conv + core)


def dsa_forward(config: ModelConfig, t: int) -> tuple[float, float]:
    """(attention forward, indexer forward) FLOPs of one DSA layer."""
    h, a, ix = config.hidden, config.dsa, config.dsa.indexer
    heads, lat = a.num_heads, a.kv_lora_rank
    proj = 2 * (h * a.q_lora_rank + a.q_lora_rank * heads * a.qk_head_dim + h * lat + heads * a.v_head_dim * h)
    absorb = 2 * heads * (a.qk_head_dim * lat + lat * a.v_head_dim)
    keys = _sum_min(t, ix.width)
    attention = t * (proj + absorb) + keys * heads * 2 * (2 * lat)
    index_proj = 2 * (a.q_lora_rank * ix.n_heads * ix.head_dim + h * ix.head_dim + h * ix.n_heads)
    scores = _sum_pools(t, ix.kpool) * 2 * ix.n_heads * (ix.head_dim + 1)
    return float(attention), float(t * index_proj + scores)


def mlp_forward(config: ModelConfig, layer_idx: int, t: int) -> float:
    h = config.hidden
    if config.mlp_types[layer_idx] == MLP_DENSE:
        return float(t * 6 * h * config.dense_mlp.intermediate_size)
    m = config.moe
    return float(t * (2 * h * m.num_experts + (m.top_k + m.num_shared_experts) * 6 * h * m.expert_dim))


def mhc_forward(config: ModelConfig, t: int) -> float:
    s, h = config.mhc.num_streams, config.hidden
    logits = 2 * s * h * (2 * s + s * s)
    mixes = 2 * s * h + 2 * s * s * h + 2 * s * h  # pre-weighting, comb, post
    return float(t * 2 * (logits + mixes))  # two sublayers per layer


def step_flops(
    config: ModelConfig, seq_len: int, *, recompute: bool, chunked_loss: bool = True, moe_recompute: bool = False
) -> StepFlops:
    """FLOPs to train on one sequence of `seq_len` tokens (see the module docstring).

    moe_recompute: MoE layers run their sequence chunks under their own checkpoint (memory
    option moe_chunking), which repeats each MoE forward once more in backward.
    """
    t = seq_len
    fwd = {"kda": 0.0, "dsa": 0.0, "indexer": 0.0, "mlp": 0.0, "mhc": 0.0}
    moe_fwd = 0.0
    for i, kind in enumerate(config.layer_types):
        if kind == LAYER_KDA:
            fwd["kda"] += kda_forward(config, t)
        elif kind == LAYER_DSA:
            attn, index = dsa_forward(config, t)
            fwd["dsa"] += attn
            if config.indexer_runs(i):
                fwd["indexer"] += index
        mlp = mlp_forward(config, i, t)
        fwd["mlp"] += mlp
        if config.mlp_types[i] == MLP_MOE:
            moe_fwd += mlp
        fwd["mhc"] += mhc_forward(config, t)
    fwd["lm_head"] = float(2 * t * config.hidden * config.vocab_size)
    trainable = sum(v for k, v in fwd.items() if k != "indexer")
    model = 3 * trainable + fwd["indexer"]
    layers_forward = sum(v for k, v in fwd.items() if k != "lm_head")
    hardware = (
        model
        + (layers_forward if recompute else 0.0)
        + (fwd["lm_head"] if chunked_loss else 0.0)
        + (moe_fwd if moe_recompute else 0.0)
    )
    return StepFlops(model=model, hardware=hardware, forward=fwd)


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak of a GPU by name; None when unknown (then MFU is not reported)."""
    if not device_name:
        return None
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None
