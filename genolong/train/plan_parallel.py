"""The memory plan's terms under a parallel layout `--parallel dp=..,cp=..,tp=..,ep=..` (docs/parallel.md, "The plan").

`genolong.train.plan.estimate_memory` adds these to the single-GPU items; with one process
(layout 1, no FSDP) every term here is zero and the plan is the single-GPU plan.

Tokens. A data-parallel rank (dp x ep: each reads its own sequences) holds T = batch x seq
tokens per micro-batch; cp splits them into shards of Tc = T / cp, and tp (sequence
parallelism) keeps Ts = Tc / tp of each shard between the sublayers. Per-token work that is
split by heads or columns over tp costs the same bytes as Ts tokens with every head, so the
single-GPU items counted per token are paid on Ts tokens; the tensors that every tp rank holds
for the whole shard (a sublayer's gathered input, DSA's latents, KDA's low-rank gates, the
gathered indexer selections) are paid on Tc, and those that every cp rank holds for the whole
sequence (DSA's gathered latent; with the Ulysses KDA split, the gathered input) on T.

Parameters fall into three classes (genolong.parallel.tensor_plan): split over tp (attention
heads, dense MLP, shared expert), split over ep (routed experts), replicated (embedding, lm_head,
norms, mHC, router, indexer, the low-rank and latent projections). `--fsdp` shards each class
further over the ranks that hold the same part (its gradient group: dp x ep x cp for the tp
class, dp x cp x tp for experts, every rank for the replicated ones), so every class ends up
divided by the world size, at the price of gathering one layer at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from genolong.errors import GenolongError
from genolong.model.config import LAYER_DSA, LAYER_KDA, MLP_DENSE, MLP_MOE, ModelConfig
from genolong.model.param_count import param_count
from genolong.parallel.layout import ParallelLayout, check_layout

FP32 = 4
GIB = 1024**3
KDA_MODES = ("state", "ulysses")
# The original recipe's real-data MoE chunking: on real data the busiest expert-parallel rank receives ~4x the mean rows.
MOE_SKEW = 4.0
GPUS_PER_NODE = 8
# Link speeds used only to rank layouts by communication (spec sheets, not measurements):
# NVLink per GPU and direction, and one 400 Gb/s NIC per GPU between nodes.
NVLINK_BYTES_S = {"h100": 450e9, "h200": 450e9, "b200": 900e9}
NIC_BYTES_S = 50e9
# What torch.cuda reports as total memory, GiB (H200 measured on the project's machine; H100 80 GB
# and B200 as commonly reported; the seed gives "about 178 GiB" for a B200).
GPU_GIB = {"h100": 79.1, "h200": 139.8, "b200": 178.4}


@dataclass(frozen=True)
class ParallelSetup:
    """How one training step is spread: the layout and the choices the plan needs beside it.

    fsdp: weights, gradients and optimizer state sharded over each parameter's replica ranks.
    kda_mode: how cp splits KDA layers ("state" passing or "ulysses" head split).
    optimizer_on_host: fp32 masters and AdamW moments kept in host RAM (a plan: not implemented).
    moe_skew: rows received by the busiest ep rank over the mean (only matters at ep > 1).
    """

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    fsdp: bool = False
    kda_mode: str = "state"
    optimizer_on_host: bool = False
    gpus_per_node: int = GPUS_PER_NODE
    moe_skew: float = MOE_SKEW

    def __post_init__(self) -> None:
        if self.kda_mode not in KDA_MODES:
            raise GenolongError(f"--kda-cp {self.kda_mode!r} is not one of {', '.join(KDA_MODES)}; use state or ulysses")
        if self.gpus_per_node < 1:
            raise GenolongError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        if not (math.isfinite(self.moe_skew) and self.moe_skew >= 1):
            raise GenolongError(f"--moe-skew is the busiest rank over the mean, at least 1; got {self.moe_skew}")

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def sharded(self) -> bool:
        """FSDP changes anything only when some parameter has more than one copy."""
        return self.fsdp and self.world > 1

    @property
    def gpus_on_node(self) -> int:
        return min(self.world, self.gpus_per_node)

    def describe(self) -> str:
        extras = [f"kda={self.kda_mode}"] if self.layout.cp > 1 and self.kda_mode != "state" else []
        extras += ["fsdp"] if self.fsdp else []
        extras += ["optimizer on host"] if self.optimizer_on_host else []
        return ", ".join([str(self.layout), *extras])


def single_gpu_setup(n_gpus: int) -> ParallelSetup:
    """What the plan's `n_gpus` has always meant: the sequence split n ways (cp) with weights,
    gradients and optimizer state sharded n ways."""
    if n_gpus < 1:
        raise GenolongError(f"--gpus must be >= 1, got {n_gpus}")
    return ParallelSetup(layout=ParallelLayout(cp=n_gpus), fsdp=n_gpus > 1)


def gpu_memory_bytes(gpu_type: str) -> int:
    """--gpu-type: h100, h200, b200 (GPU_GIB) or a number of GiB."""
    name = str(gpu_type).strip().lower()
    if name in GPU_GIB:
        return int(GPU_GIB[name] * GIB)
    try:
        gib = float(name)
    except ValueError:
        gib = 0.0
    if not (math.isfinite(gib) and gib > 0):
        raise GenolongError(f"--gpu-type {gpu_type!r} is not one of {', '.join(GPU_GIB)} or a size in GiB; e.g. --gpu-type b200 or --gpu-type 94")
    return int(gib * GIB)


def check_setup(config: ModelConfig, setup: ParallelSetup, *, seq_len: int, batch: int) -> None:
    """check_layout's rules, and the Ulysses KDA split's: each rank's heads must be whole."""
    check_layout(setup.layout, config, seq_len=seq_len, batch=batch)
    lay = setup.layout
    heads = config.kda.num_heads
    if setup.kda_mode == "ulysses" and lay.cp > 1 and LAYER_KDA in config.layer_types and heads % (lay.cp * lay.tp):
        raise GenolongError(
            f"--parallel {lay} with --kda-cp ulysses: the model's {heads} KDA heads do not split over cp x tp = {lay.cp * lay.tp} ranks; "
            "use a cp x tp that divides them, or --kda-cp state"
        )


@dataclass(frozen=True)
class Tokens:
    """Tokens per GPU in one micro-batch: the whole sequences of a data-parallel rank (`whole`),
    its cp shard (`shard`) and the sequence-parallel part of the shard (`seq`)."""

    whole: int
    shard: int
    seq: int
    sequences: int = 1


def tokens_per_gpu(seq_len: int, batch: int, layout: ParallelLayout) -> Tokens:
    return Tokens(
        whole=batch * seq_len,
        shard=batch * math.ceil(seq_len / layout.cp),
        seq=batch * math.ceil(seq_len / (layout.cp * layout.tp)),
        sequences=batch,
    )


# ----------------------------------------------------------------------------- parameters


@dataclass
class ParamSplit:
    """Parameter counts by where they live; `*_fp32` are the ones the model keeps in fp32."""

    tp: int = 0
    ep: int = 0
    replicated: int = 0
    tp_fp32: int = 0
    ep_fp32: int = 0
    replicated_fp32: int = 0

    def add(self, other: ParamSplit) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def local(self, layout: ParallelLayout) -> ParamSplit:
        """This rank's part under tp / ep, before any FSDP sharding."""
        return ParamSplit(
            tp=self.tp // layout.tp,
            ep=self.ep // layout.ep,
            replicated=self.replicated,
            tp_fp32=self.tp_fp32 // layout.tp,
            ep_fp32=self.ep_fp32 // layout.ep,
            replicated_fp32=self.replicated_fp32,
        )

    def bytes(self, dtype_bytes: int) -> int:
        """Parameter (or gradient) bytes: low-precision ones in the run's dtype, fp32 ones in fp32."""
        total, fp32 = self.tp + self.ep + self.replicated, self.tp_fp32 + self.ep_fp32 + self.replicated_fp32
        if dtype_bytes >= FP32:
            return total * dtype_bytes
        return (total - fp32) * dtype_bytes + fp32 * FP32


def layer_params(config: ModelConfig, idx: int) -> ParamSplit:
    """One decoder layer's parameters by class (the rules of genolong.parallel.tensor_plan)."""
    h = config.hidden
    out = ParamSplit()
    n = config.mhc.num_streams
    hc_outputs = (2 + n) * n
    # Two hyper-connections (projection, fp32 base and scale) and two norms.
    out.replicated += 2 * (hc_outputs * n * h + hc_outputs + 3) + 2 * h
    out.replicated_fp32 += 2 * (hc_outputs + 3)
    if config.layer_types[idx] == LAYER_KDA:
        k = config.kda
        c, d, heads = k.qkv_dim, k.head_dim, k.num_heads
        conv, gate_vectors = 3 * c * k.conv_kernel, c + heads  # conv1d; dt_bias and A_log
        # q/k/v, f_b, b_proj, g_b, o_proj rows or columns per head.
        out.tp += 3 * h * c + conv + d * c + gate_vectors + h * heads + d * c + c * h
        out.tp_fp32 += conv + gate_vectors
        out.replicated += 2 * h * d + d  # f_a, g_a (hidden -> head_dim) and the shared o_norm weight
    elif config.layer_types[idx] == LAYER_DSA:
        a = config.dsa
        bias = 1 if a.attention_bias else 0
        out.tp += a.q_lora_rank * a.num_heads * a.qk_head_dim + a.kv_lora_rank * a.num_heads * (a.qk_head_dim + a.v_head_dim)
        out.tp += a.num_heads * a.v_head_dim * h
        out.replicated += (h + bias + 1) * a.q_lora_rank + (h + bias + 1) * a.kv_lora_rank + bias * h
        if config.indexer_runs(idx):
            ix = a.indexer
            out.replicated += a.q_lora_rank * ix.n_heads * ix.head_dim + h * ix.head_dim + 2 * ix.head_dim
            out.replicated += h * ix.n_heads + ix.kpool * ix.head_dim + ix.head_dim * h
    if config.mlp_types[idx] == MLP_DENSE:
        out.tp += 3 * h * config.dense_mlp.intermediate_size
    elif config.mlp_types[idx] == MLP_MOE:
        m = config.moe
        out.ep += m.num_experts * 3 * h * m.expert_dim
        out.tp += 3 * h * m.expert_dim * m.num_shared_experts
        out.replicated += m.num_experts * h  # the router, fp32
        out.replicated_fp32 += m.num_experts * h
    return out


def model_params(config: ModelConfig) -> ParamSplit:
    total = ParamSplit(replicated=2 * config.vocab_size * config.hidden + config.hidden)  # embedding, lm_head, final norm
    for i in range(config.num_layers):
        total.add(layer_params(config, i))
    return total


def parameter_classes(config: ModelConfig, layout: ParallelLayout) -> list[tuple[str, ParamSplit, int, int]]:
    """(name, parameters, ranks splitting each one, ranks holding a copy of each part) per class:
    the copies are the ranks its gradient is summed over (genolong.parallel.tensor_plan.REDUCE_GROUPS)."""
    whole = model_params(config)
    lay = layout
    return [
        ("tp-split", ParamSplit(tp=whole.tp, tp_fp32=whole.tp_fp32), lay.tp, lay.dp * lay.ep * lay.cp),
        ("experts", ParamSplit(ep=whole.ep, ep_fp32=whole.ep_fp32), lay.ep, lay.dp * lay.cp * lay.tp),
        ("replicated", ParamSplit(replicated=whole.replicated, replicated_fp32=whole.replicated_fp32), 1, lay.world_size),
    ]


def _static(params: ParamSplit, dtype_bytes: int, buffers: int) -> dict[str, int]:
    """Weights, gradients and MasterAdamW state of `params` (as genolong.train.plan.static_bytes)."""
    count = params.tp + params.ep + params.replicated
    fp32 = count if dtype_bytes >= FP32 else params.tp_fp32 + params.ep_fp32 + params.replicated_fp32
    grads = params.bytes(dtype_bytes)
    return {"weights": grads + buffers * FP32, "gradients": grads, "optimizer state": (count - fp32) * FP32 + 2 * count * FP32}


def static_per_gpu(config: ModelConfig, setup: ParallelSetup, dtype_bytes: int = 2) -> dict[str, int]:
    """Weights, gradients and optimizer state one GPU keeps: each class divided by its split, and
    by its replica count under FSDP (module docstring). Buffers (the routers' fp32 correction
    biases) are replicated weights."""
    lay = setup.layout
    buffers = param_count(config).buffers
    out = {"weights": 0, "gradients": 0, "optimizer state": 0}
    for name, params, split, replicas in parameter_classes(config, lay):
        shards = split * (replicas if setup.sharded else 1)
        for item, value in _static(params, dtype_bytes, buffers if name == "replicated" else 0).items():
            out[item] += math.ceil(value / shards)
    return out


def fsdp_gathered_bytes(config: ModelConfig, setup: ParallelSetup, dtype_bytes: int = 2) -> int:
    """FSDP's unsharded working copy: the largest layer's local parameters gathered, the next
    layer's prefetched, and the unsharded gradient before its reduce-scatter (3 x the layer),
    or the lm_head's weight and gradient (the embedding is gathered alone) if larger."""
    if not setup.sharded:
        return 0
    largest = max(layer_params(config, i).local(setup.layout).bytes(dtype_bytes) for i in range(config.num_layers))
    head = config.vocab_size * config.hidden * dtype_bytes
    return max(3 * largest, 2 * head)


# ----------------------------------------------------------------------------- activations


def _rmsnorm(dim: int, a: int) -> int:
    return FP32 * dim + 2 * a * dim  # as genolong.train.plan._rmsnorm


def layer_parallel_items(config: ModelConfig, idx: int, setup: ParallelSetup, t: Tokens, a: int, moe_chunked: bool, moe_routed: int) -> dict[str, int]:
    """Bytes a layer saves for backward beyond its per-token items paid on Ts tokens (module docstring).

    moe_routed: the routed MoE items per token (genolong.train.plan._moe), used when the MoE saves
    over the whole sequence (not chunked) at ep > 1."""
    lay, h = setup.layout, config.hidden
    over_tp = t.shard - t.seq  # tokens each tp rank also holds, beyond its own
    over_cp = t.whole - t.shard  # tokens each cp rank also holds, beyond its shard
    out: dict[str, int] = {}
    mixer = config.layer_types[idx]
    if lay.tp > 1:
        # The mixer's and the MLP's (or shared expert's) gathered, normed input, read by their projections.
        gathered = 1 + (config.mlp_types[idx] == MLP_DENSE or (config.mlp_types[idx] == MLP_MOE and config.moe.num_shared_experts > 0))
        replicated = gathered * a * h
        if mixer == LAYER_KDA:
            replicated += 2 * a * config.kda.head_dim  # f_a / g_a outputs
        else:
            d = config.dsa
            replicated += _rmsnorm(d.q_lora_rank, a) + _rmsnorm(d.kv_lora_rank, a) + 4 * d.indexer.width
        out["held for the whole shard by each tp rank"] = replicated * over_tp
    if lay.cp > 1:
        if mixer == LAYER_DSA:
            out["dsa gathered latent (cp)"] = a * config.dsa.kv_lora_rank * over_cp
        elif setup.kda_mode == "ulysses":
            out["kda gathered input (cp, ulysses)"] = (a * h + 2 * a * config.kda.head_dim) * over_cp
        else:
            # The state-passing reference widens v by Dk columns (it computes the shard's transition too).
            out["kda widened values (cp, state passing)"] = a * config.kda.qkv_dim * t.seq
    if lay.ep > 1 and config.mlp_types[idx] == MLP_MOE and not moe_chunked:
        k = config.moe.top_k
        out["moe rows at the busiest ep rank"] = int((setup.moe_skew - 1) * moe_routed * t.seq)
        out["moe dispatch buffers (ep)"] = 2 * k * a * h * t.seq
    return out


def dispatch_bytes(config: ModelConfig, setup: ParallelSetup, rows_tokens: int, a: int) -> int:
    """The home rank's copies of one MoE call's rows under ep: sorted rows sent, results received."""
    return 2 * config.moe.top_k * a * config.hidden * rows_tokens if setup.layout.ep > 1 else 0


# ----------------------------------------------------------------------------- communication


@dataclass
class Traffic:
    """Bytes one GPU sends per optimizer step, by what sends them, and whether each crosses nodes."""

    items: dict[str, tuple[int, bool]] = field(default_factory=dict)

    def add(self, name: str, nbytes: float, across_nodes: bool) -> None:
        if nbytes > 0:
            self.items[name] = (int(nbytes), across_nodes)

    @property
    def total(self) -> int:
        return sum(b for b, _ in self.items.values())

    @property
    def across_nodes(self) -> int:
        return sum(b for b, across in self.items.values() if across)

    def seconds(self, gpu_type: str = "h200") -> float:
        """A ranking estimate at spec link speeds (NVLINK_BYTES_S, NIC_BYTES_S), no overlap."""
        within = NVLINK_BYTES_S.get(gpu_type, NVLINK_BYTES_S["h200"])
        return sum(b / (NIC_BYTES_S if across else within) for b, across in self.items.values())


def spans_nodes(setup: ParallelSetup, dims: tuple[str, ...]) -> bool:
    """Whether a group over `dims` has ranks on more than one node. Ranks are numbered with tp
    innermost, then cp, ep, dp (genolong.parallel.mesh), so a dimension's ranks are `stride` apart."""
    lay = setup.layout
    stride = {"tp": 1, "cp": lay.tp, "ep": lay.tp * lay.cp, "dp": lay.tp * lay.cp * lay.ep}
    return any(getattr(lay, d) > 1 and stride[d] * getattr(lay, d) > setup.gpus_per_node for d in dims)


def traffic(config: ModelConfig, setup: ParallelSetup, t: Tokens, *, a: int = 2, recompute: bool = True, grad_accum: int = 1) -> Traffic:
    """Bytes each GPU sends per optimizer step (docs/parallel.md, "The plan"): the activations'
    collectives in every pass over the layers (forward, the recompute, backward), the gradient
    sum once per step, FSDP's gathers and reduce-scatters per micro-batch."""
    lay, h = setup.layout, config.hidden
    passes = 3 if recompute else 2
    fwd_passes = passes - 1  # the indexer runs without gradient
    out = Traffic()
    kda = sum(x == LAYER_KDA for x in config.layer_types)
    dsa = sum(x == LAYER_DSA for x in config.layer_types)
    moe = sum(x == MLP_MOE for x in config.mlp_types)
    layers = config.num_layers
    micro_batches = grad_accum
    if lay.tp > 1:
        f = (lay.tp - 1) / lay.tp
        # Each sublayer all-gathers its input and reduce-scatters its output: [Tc, h] each way.
        out.add("tp: sublayer gathers and reduce-scatters", micro_batches * passes * layers * 4 * t.shard * h * a * f, spans_nodes(setup, ("tp",)))
        width = config.dsa.indexer.width
        out.add("tp: indexer selections (int32)", micro_batches * fwd_passes * dsa * t.shard * width * 4 * f, spans_nodes(setup, ("tp",)))
    if lay.cp > 1:
        f = (lay.cp - 1) / lay.cp
        across = spans_nodes(setup, ("cp",))
        if setup.kda_mode == "ulysses":
            out.add("cp: KDA input gather + output reduce-scatter", micro_batches * passes * kda * 2 * t.whole * h * a * f / lay.tp, across)
        else:
            k = config.kda
            # Every rank's (S_ext, M) per sequence and local head, fp32 [Dk, Dv + Dk], gathered by all.
            state = t.sequences * (k.num_heads // lay.tp) * k.head_dim * 2 * k.head_dim * FP32
            out.add("cp: KDA states (S_ext, M)", micro_batches * passes * kda * (lay.cp - 1) * state, across)
        d = config.dsa
        out.add("cp: DSA latent gather (+ gradient back)", micro_batches * passes * dsa * t.whole * d.kv_lora_rank * a * f, across)
        out.add("cp: indexer pooled keys", micro_batches * fwd_passes * dsa * t.whole // d.indexer.kpool * d.indexer.head_dim * a * f, across)
    if lay.ep > 1:
        f = (lay.ep - 1) / lay.ep
        out.add("ep: MoE dispatch + return", micro_batches * passes * moe * 2 * t.seq * config.moe.top_k * h * a * f, spans_nodes(setup, ("ep",)))
    replica_dims = {"tp-split": ("dp", "ep", "cp"), "experts": ("dp", "cp", "tp"), "replicated": ("dp", "ep", "cp", "tp")}
    for name, params, _, copies in parameter_classes(config, lay):
        if copies == 1:
            continue
        local = params.local(lay).bytes(a)
        f = (copies - 1) / copies
        across = spans_nodes(setup, replica_dims[name])
        if setup.sharded:
            # Two all-gathers of the weights per micro-batch (forward; recompute and backward) and one reduce-scatter.
            out.add(f"fsdp: {name} gathers + gradient reduce-scatter", micro_batches * 3 * local * f, across)
        else:
            out.add(f"dp: {name} gradient all-reduce", 2 * local * f, across)
    return out
