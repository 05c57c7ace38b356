"""Model configuration: one frozen dataclass per component and one `ModelConfig` over them.

The layer schedule (which layers are KDA or DSA, dense MLP or MoE, full or shared indexer) is
*derived* from a rule by `ModelConfig.build` (DSA iff i % 4 == 3, dense MLP in the first three
layers, every indexer "full") but *stored* as explicit per-layer tuples, so that a checkpoint
with another schedule maps onto the same config. `validate()` checks everything before any
tensor is allocated and raises `GenolongError` naming the field and the fix.

Field names are genolong's; `HF_*` below record how they correspond to transformers'
`Glm5NextTextConfig` (the reference implementation) for the checkpoint code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from genolong.errors import GenolongError

LAYER_KDA, LAYER_DSA = "kda", "dsa"
MLP_DENSE, MLP_MOE = "dense", "moe"
INDEXER_FULL, INDEXER_SHARED = "full", "shared"

# transformers' per-layer strings -> genolong's (and back), for checkpoint configs.
HF_LAYER_TYPES = {"linear_attention": LAYER_KDA, "indexed_attention": LAYER_DSA, "full_attention": LAYER_DSA}
HF_MLP_TYPES = {"dense": MLP_DENSE, "sparse": MLP_MOE}
TO_HF_LAYER_TYPES = {LAYER_KDA: "linear_attention", LAYER_DSA: "indexed_attention"}
TO_HF_MLP_TYPES = {MLP_DENSE: "dense", MLP_MOE: "sparse"}


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (linear attention with a per-channel forget gate)."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    # Bounded gate g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)): a scale, not a clamp.
    # None selects the unbounded form g = -exp(A_log) * softplus(f + dt_bias).
    lower_bound: float | None = -5.0

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class IndexerConfig:
    """The DSA "lightning" indexer: scores pools of `kpool` keys, keeps `topk // kpool` pools."""

    n_heads: int
    head_dim: int
    topk: int
    kpool: int
    always_select_tail: bool = True

    @property
    def topk_pools(self) -> int:
        return self.topk // self.kpool

    @property
    def width(self) -> int:
        """Index slots per query: the selected pools' tokens plus the incomplete tail pool."""
        return self.topk + (self.kpool - 1 if self.always_select_tail else 0)


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention over NoPE MLA (no rotary part: qk_rope_head_dim is 0)."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    v_head_dim: int
    indexer: IndexerConfig
    attention_bias: bool = False

    @property
    def softmax_scale(self) -> float:
        # The reference scales by the full q/k head dim, not by the latent width of the absorbed form.
        return self.qk_head_dim**-0.5


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with a sigmoid router, correction bias, normalised top-k and a shared expert."""

    num_experts: int
    top_k: int
    expert_dim: int
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    swiglu_limit: float = 10.0


@dataclass(frozen=True)
class DenseMLPConfig:
    intermediate_size: int
    swiglu_limit: float = 10.0


@dataclass(frozen=True)
class MHCConfig:
    """Manifold-constrained hyper-connections: `num_streams` residual streams per token."""

    num_streams: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden: int
    vocab_size: int
    kda: KDAConfig
    dsa: DSAConfig
    moe: MoEConfig
    dense_mlp: DenseMLPConfig
    mhc: MHCConfig
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rms_eps: float = 1e-5
    initializer_range: float = 0.02
    name: str = field(default="custom", compare=False)

    @staticmethod
    def build(*, num_layers: int, **fields) -> ModelConfig:
        """A config whose per-layer schedules follow the GLM-5.3-Flash rule unless given."""
        fields.setdefault("layer_types", default_layer_types(num_layers))
        fields.setdefault("mlp_types", default_mlp_types(num_layers))
        fields.setdefault("indexer_types", (INDEXER_FULL,) * num_layers)
        return ModelConfig(num_layers=num_layers, **_as_tuples(fields))

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **_as_tuples(changes))

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_DSA)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_types) if t == MLP_MOE)

    # indexer_types entries of KDA layers mean nothing (checkpoint configs write a pattern over all
    # layers); a "shared" DSA layer reuses the top-k of the most recent "full" DSA layer.
    def indexer_runs(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is DSA with its own indexer."""
        return self.layer_types[layer_idx] == LAYER_DSA and self.indexer_types[layer_idx] == INDEXER_FULL

    def reuses_topk(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is DSA and takes its top-k from the last full DSA layer."""
        return self.layer_types[layer_idx] == LAYER_DSA and self.indexer_types[layer_idx] == INDEXER_SHARED

    def shares_topk_with_next(self, layer_idx: int) -> bool:
        """Whether this full DSA layer must hand its top-k on (the next DSA layer is shared)."""
        if not self.indexer_runs(layer_idx):
            return False
        later = [i for i in self.dsa_layers if i > layer_idx]
        return bool(later) and self.reuses_topk(later[0])

    def validate(self) -> ModelConfig:
        """Raise GenolongError for the first impossible field (what is wrong, then the fix)."""
        _positive(self, "num_layers", "hidden", "vocab_size", "rms_eps")
        for name in ("layer_types", "mlp_types", "indexer_types"):
            value = getattr(self, name)
            if len(value) != self.num_layers:
                _fail(
                    f"{name} has {len(value)} entries but num_layers is {self.num_layers}",
                    f"give one entry per layer or leave {name} out to derive it",
                )
        _members(self.layer_types, "layer_types", (LAYER_KDA, LAYER_DSA))
        _members(self.mlp_types, "mlp_types", (MLP_DENSE, MLP_MOE))
        _members(self.indexer_types, "indexer_types", (INDEXER_FULL, INDEXER_SHARED))

        if LAYER_KDA in self.layer_types:
            _positive(self.kda, "num_heads", "head_dim", "conv_kernel", prefix="kda")
            if self.kda.lower_bound is not None and not self.kda.lower_bound < 0:
                _fail(
                    f"kda.lower_bound must be negative or None, got {self.kda.lower_bound}", "use -5.0 (GLM-5.3-Flash)"
                )

        if self.dsa_layers:
            d, ix = self.dsa, self.dsa.indexer
            _positive(d, "num_heads", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim", prefix="dsa")
            _positive(ix, "n_heads", "head_dim", "topk", "kpool", prefix="dsa.indexer")
            if ix.topk % ix.kpool:
                _fail(
                    f"dsa.indexer.topk ({ix.topk}) must be a multiple of dsa.indexer.kpool ({ix.kpool})",
                    f"set topk to {max(ix.kpool, ix.topk // ix.kpool * ix.kpool)}",
                )
            first = self.dsa_layers[0]
            if self.indexer_types[first] != INDEXER_FULL:
                _fail(
                    f"indexer_types[{first}] is 'shared' but layer {first} is the first DSA layer "
                    "(nothing to share from)",
                    "make the first DSA layer 'full'",
                )

        if MLP_DENSE in self.mlp_types:
            _positive(self.dense_mlp, "intermediate_size", "swiglu_limit", prefix="dense_mlp")
        if self.moe_layers:
            m = self.moe
            _positive(m, "num_experts", "top_k", "expert_dim", "n_group", "topk_group", "swiglu_limit", prefix="moe")
            if m.num_shared_experts < 0:
                _fail(f"moe.num_shared_experts must be >= 0, got {m.num_shared_experts}", "use 1 (GLM-5.3-Flash)")
            if m.num_experts % m.n_group:
                _fail(
                    f"moe.num_experts ({m.num_experts}) is not divisible by moe.n_group ({m.n_group})", "use n_group 1"
                )
            if m.topk_group > m.n_group:
                _fail(f"moe.topk_group ({m.topk_group}) exceeds moe.n_group ({m.n_group})", "set topk_group <= n_group")
            if m.n_group > 1 and m.num_experts // m.n_group < 2:
                _fail("moe groups need at least 2 experts each (groups are scored by their top-2)", "lower moe.n_group")
            if m.top_k > m.num_experts // m.n_group * m.topk_group:
                _fail(
                    f"moe.top_k ({m.top_k}) exceeds the experts reachable in moe.topk_group groups",
                    "lower top_k or raise num_experts / topk_group",
                )
        _positive(self.mhc, "num_streams", "sinkhorn_iters", prefix="mhc")
        if self.mhc.eps < 0:
            _fail(f"mhc.eps must be >= 0, got {self.mhc.eps}", "use 1e-6")
        return self


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """GLM-5.3-Flash: every fourth layer (3, 7, 11, ...) is DSA, the rest KDA."""
    return tuple(LAYER_DSA if i % 4 == 3 else LAYER_KDA for i in range(num_layers))


def default_mlp_types(num_layers: int) -> tuple[str, ...]:
    """GLM-5.3-Flash: a dense MLP in the first three layers, MoE after."""
    return tuple(MLP_DENSE if i < 3 else MLP_MOE for i in range(num_layers))


def _as_tuples(fields: dict) -> dict:
    for name in ("layer_types", "mlp_types", "indexer_types"):
        if name in fields and not isinstance(fields[name], tuple):
            fields[name] = tuple(fields[name])
    return fields


def _fail(problem: str, fix: str) -> None:
    raise GenolongError(f"model config: {problem}; {fix}")


def _positive(obj, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            where = f"{prefix}.{name}" if prefix else name
            _fail(f"{where} must be positive, got {value!r}", f"set {where} to a positive number")


def _members(values: tuple[str, ...], name: str, allowed: tuple[str, ...]) -> None:
    for i, value in enumerate(values):
        if value not in allowed:
            _fail(f"{name}[{i}] is {value!r}", f"use one of {allowed}")
