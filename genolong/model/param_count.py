"""Parameter counts from the architecture's arithmetic, per component.

Written from the architecture description (docs, SYSTEM.md), not from the modules, so that a
test comparing these numbers with `sum(p.numel())` of a built model catches a module that
allocates something the architecture does not have (or misses something it does).

Conventions:
- "parameters" are trainable tensors. The MoE router's `e_score_correction_bias` is a buffer
  (it is adjusted by a load-balancing rule, not by gradients) and is counted in `buffers`.
- "active per token" counts every parameter a token's forward pass multiplies with: all of
  them except the routed experts that the router did not pick (top_k of num_experts per MoE
  layer). Embedding and lm_head are counted in full, as model cards do. MTP heads and vision
  towers of checkpoints are not part of genolong's model and are not counted.
- bytes assume bf16 storage (2 bytes) for every parameter and buffer; the few fp32 tensors
  (router, gate biases, mHC base/scale, conv) are a rounding error at this scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genolong.model.config import LAYER_DSA, LAYER_KDA, MLP_DENSE, MLP_MOE, ModelConfig

BF16_BYTES = 2

# Display order of the components in `model-info`.
COMPONENTS = (
    "embedding",
    "kda attention",
    "dsa attention",
    "dsa indexer",
    "dense mlp",
    "moe routed experts",
    "moe shared experts",
    "moe router",
    "mhc",
    "layer norms",
    "final norm",
    "lm_head",
)


@dataclass
class ParamCount:
    components: dict[str, int] = field(default_factory=dict)
    buffers: int = 0
    active: int = 0

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def bytes_bf16(self) -> int:
        return (self.total + self.buffers) * BF16_BYTES


def kda_params(config: ModelConfig) -> int:
    h, k = config.hidden, config.kda
    d, n, qkv = k.head_dim, k.num_heads, k.qkv_dim
    projections = 3 * h * qkv  # q, k, v
    short_convs = 3 * qkv * k.conv_kernel  # depthwise, no bias
    forget_gate = h * d + d * qkv + qkv + n  # low-rank f_a, f_b; dt_bias per channel; A_log per head
    beta = h * n
    output_gate = h * d + d * qkv  # low-rank g_a, g_b
    gated_norm = d  # one weight per head channel, shared by the heads
    out = qkv * h
    return projections + short_convs + forget_gate + beta + output_gate + gated_norm + out


def dsa_attention_params(config: ModelConfig) -> int:
    h, d = config.hidden, config.dsa
    bias = 1 if d.attention_bias else 0
    q = h * d.q_lora_rank + bias * d.q_lora_rank + d.q_lora_rank + d.q_lora_rank * d.num_heads * d.qk_head_dim
    kv = (
        h * d.kv_lora_rank  # NoPE: no rotary key part in the down projection
        + bias * d.kv_lora_rank
        + d.kv_lora_rank
        + d.kv_lora_rank * d.num_heads * (d.qk_head_dim + d.v_head_dim)
    )
    out = d.num_heads * d.v_head_dim * h + bias * h
    return q + kv + out


def indexer_params(config: ModelConfig) -> int:
    h, d, ix = config.hidden, config.dsa, config.dsa.indexer
    wq = d.q_lora_rank * ix.n_heads * ix.head_dim  # from the attention's q latent
    wk = h * ix.head_dim
    k_norm = 2 * ix.head_dim  # LayerNorm with bias
    head_weights = h * ix.n_heads
    pooling = ix.kpool * ix.head_dim + ix.head_dim * h  # positional term inside a pool + compression gate
    return wq + wk + k_norm + head_weights + pooling


def dense_mlp_params(config: ModelConfig) -> int:
    return 3 * config.hidden * config.dense_mlp.intermediate_size


def moe_params(config: ModelConfig) -> tuple[int, int, int, int]:
    """(routed experts, shared experts, router weight, router buffers) of one MoE layer."""
    h, m = config.hidden, config.moe
    routed = m.num_experts * 3 * h * m.expert_dim
    shared = 3 * h * m.expert_dim * m.num_shared_experts
    return routed, shared, m.num_experts * h, m.num_experts


def mhc_params(config: ModelConfig) -> int:
    """One hyper-connection (a layer has two: before attention and before the MLP)."""
    s = config.mhc.num_streams
    outputs = (2 + s) * s  # pre (s), post (s), comb (s x s)
    return outputs * s * config.hidden + outputs + 3  # projection, bias, one scale per output group


def param_count(config: ModelConfig) -> ParamCount:
    c = {name: 0 for name in COMPONENTS}
    h = config.hidden
    c["embedding"] = config.vocab_size * h
    c["lm_head"] = config.vocab_size * h
    c["final norm"] = h
    buffers = 0
    inactive = 0
    for i in range(config.num_layers):
        if config.layer_types[i] == LAYER_KDA:
            c["kda attention"] += kda_params(config)
        elif config.layer_types[i] == LAYER_DSA:
            c["dsa attention"] += dsa_attention_params(config)
            if config.indexer_runs(i):
                c["dsa indexer"] += indexer_params(config)
        if config.mlp_types[i] == MLP_DENSE:
            c["dense mlp"] += dense_mlp_params(config)
        elif config.mlp_types[i] == MLP_MOE:
            routed, shared, router, router_buffers = moe_params(config)
            c["moe routed experts"] += routed
            c["moe shared experts"] += shared
            c["moe router"] += router
            buffers += router_buffers
            m = config.moe
            inactive += (m.num_experts - m.top_k) * 3 * h * m.expert_dim
        c["mhc"] += 2 * mhc_params(config)
        c["layer norms"] += 2 * h
    out = ParamCount(components=c, buffers=buffers)
    out.active = out.total - inactive
    return out
