"""Memory plan: GPU and pinned-host bytes of one training step, itemised, before anything is allocated.

The seed run learned the hard way that each optimization only moves the limit to the next one,
and that host memory becomes the limit once layer inputs are offloaded (~180 GB per GPU at 1M
tokens before context parallelism). `estimate_memory` adds up, per GPU:

- static: weights, gradients and AdamW state (genolong.train.optim: bf16 parameters + fp32
  master and moments = 16 bytes per parameter; parameters kept fp32 by the model count 12);
- stored layer inputs: with full recompute each layer keeps its input, the 4-stream mHC
  residual (streams x hidden per token: 4x a plain transformer's), except the offloaded layers;
  with `layer_inputs="fp8"` 1 byte an element plus a 4-byte scale per stream (genolong.train.fp8_rows),
  on the GPU, in flight and on the host, plus the rebuilt input of the layer being recomputed;
- the working set of the layer being recomputed in backward (its saved activations, plus the
  gradients flowing in and out), or, without recompute, every layer's saved activations;
- the loss head and the largest transient: indexer query chunk, MoE chunk, loss chunk, KDA
  chunk states, DSA attention workspace (each bounded by its kernel's budget).

Per-token activation bytes are counted from the model code, tensor by tensor (module
`_layer_saved_items`); tests/train/test_plan.py checks them against a census of the tensors
autograd actually saves on CPU. The estimate is of `torch.cuda.max_memory_allocated`: the CUDA
context and allocator fragmentation are covered by `preflight`'s margin, not by the items.

Under a parallel layout (`setup`, genolong.train.plan_parallel) the same items are paid on the
tokens one GPU holds (cp shards the sequence, tp keeps a sequence-parallel part of the shard),
the weights, gradients and optimizer state are split by tp / ep and, with FSDP, by their
replicas, and the layout's own tensors are added (what every tp rank holds for the whole shard,
the gathered latent under cp, the busiest ep rank's MoE rows, FSDP's gathered layer). With one
process those terms are zero: the single-GPU plan. `n_gpus > 1` without a setup keeps its old
meaning, cp=n_gpus with FSDP. docs/parallel.md, "The plan", writes every term down.

A CPU run (`estimate_cpu_memory`) keeps all of it in host RAM, in the run's dtype (fp32 by
default: the parameters are their own master copy); offload would copy layer inputs into the
same RAM, so the CPU plan counts them as kept. The pre-flight that refuses a run which does not fit,
and its advice, are genolong.train.preflight.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from genolong.errors import GenolongError
from genolong.kernels.moe import grouped as moe_grouped
from genolong.kernels.sparse_mla import op as sparse_mla
from genolong.model.config import LAYER_DSA, LAYER_KDA, MLP_DENSE, MLP_MOE, ModelConfig
from genolong.model.param_count import param_count
from genolong.train.loss import auto_chunk_tokens
from genolong.train.options import MemoryOptions
from genolong.train.plan_parallel import (
    ParallelSetup,
    Tokens,
    dispatch_bytes,
    fsdp_gathered_bytes,
    layer_parallel_items,
    single_gpu_setup,
    static_per_gpu,
    tokens_per_gpu,
)

GIB = 1024**3
H200_BYTES = int(139.8 * GIB)  # what torch.cuda reports for an H200 (143,771,877,376 bytes)
FP32 = 4
FP8_SCALE_BYTES = 4  # a float32 scale per row of an fp8-stored layer input
# Kernel budgets (genolong/kernels): the indexer's query chunks are sized to these (the sparse
# attention's and the grouped MoE's chunks are read from their kernels); fla's KDA chunk is 64 tokens.
INDEXER_BUDGET = 2 << 30
INDEXER_GROUP = 8  # pools per group in the fused indexer's first pass (v1)
INDEXER_V2_GROUP = 4  # and in v2's
MOE_OP_BUDGET = 1 << 30
KDA_CHUNK = 64
# preflight: usable fraction of the GPU (allocator fragmentation, CUDA context, NCCL buffers)
# and of host RAM (the process itself, the page cache of the data, the OS).
GPU_USABLE = 0.92
HOST_USABLE = 0.80
# A CPU run uses the PyTorch reference ops, which keep and allocate more than the fused kernels
# the per-item counts describe: peak RSS growth of a tiny-preset training step on the CPU was
# 1.8-3.7x the activation items (4k and 8k tokens, with and without recompute, after the fast
# CPU reference ops; 2026-12-01, benchmarks/cpu_memory_plan.py). The CPU plan adds the difference
# as its own item, with a little room.
CPU_REFERENCE_FACTOR = 4.0


@dataclass
class MemoryEstimate:
    seq_len: int
    n_gpus: int
    tokens_per_gpu: int
    gpu: dict[str, int]  # itemised bytes per GPU
    host: dict[str, int]  # itemised pinned host bytes per GPU
    transients: dict[str, int]  # the candidates for "largest transient" (only the max is in gpu)
    offload_layers: int
    gpu_bytes: int  # the GPU's usable budget
    host_bytes: int  # the host's usable budget per GPU
    opts: MemoryOptions = field(repr=False, default_factory=MemoryOptions)
    device: str = "cuda"  # "cpu": `gpu` holds the CPU run's RAM items and `gpu_bytes` the RAM budget
    setup: ParallelSetup = field(default_factory=ParallelSetup)

    @property
    def node_host(self) -> dict[str, int]:
        """Host memory of one node: each item times the GPUs on it (--gpus-per-node)."""
        return {k: v * self.setup.gpus_on_node for k, v in self.host.items()}

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_total <= self.gpu_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_total <= self.host_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def short(self) -> list[str]:
        """The resources that are short, in words: GPU memory, pinned host memory, CPU RAM."""
        if self.device == "cpu":
            return [] if self.fits_gpu else ["CPU RAM"]
        out = [] if self.fits_gpu else ["GPU memory"]
        if not self.fits_host:
            out.append("pinned host memory" if self.opts.offload_pinned else "host memory")
        return out

    def as_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "n_gpus": self.n_gpus,
            "offload_layers": self.offload_layers,
            "gpu": dict(self.gpu),
            "host": dict(self.host),
            "transients": dict(self.transients),
            "gpu_total": self.gpu_total,
            "host_total": self.host_total,
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "device": self.device,
        }


# ------------------------------------------------------------------------------ static memory


def _fp32_param_count(config: ModelConfig) -> int:
    """Parameters the model keeps in fp32 whatever its dtype (genolong.model.model.FP32_PARAM_SUFFIXES)."""
    k, m, n = config.kda, config.moe, config.mhc.num_streams
    kda_layers = sum(t == LAYER_KDA for t in config.layer_types)
    moe_layers = len(config.moe_layers)
    per_kda = 3 * k.qkv_dim * k.conv_kernel + k.qkv_dim + k.num_heads  # conv, dt_bias, A_log
    per_hc = (2 + n) * n + 3  # base, scale
    return kda_layers * per_kda + moe_layers * m.num_experts * config.hidden + config.num_layers * 2 * per_hc


def static_bytes(config: ModelConfig, dtype_bytes: int = 2) -> dict[str, int]:
    """Weights, gradients, optimizer state (genolong.train.optim.MasterAdamW), whole model."""
    counts = param_count(config)
    total = counts.total
    fp32 = _fp32_param_count(config) if dtype_bytes < FP32 else total
    low = total - fp32
    weights = low * dtype_bytes + fp32 * FP32 + counts.buffers * FP32
    grads = low * dtype_bytes + fp32 * FP32
    # fp32 master copy only for low-precision parameters (fp32 ones are their own master).
    optimizer = low * FP32 + 2 * total * FP32
    return {"weights": weights, "gradients": grads, "optimizer state": optimizer}


def largest_param(config: ModelConfig) -> int:
    h = config.hidden
    candidates = [config.vocab_size * h]
    if config.moe_layers:
        candidates.append(config.moe.num_experts * 2 * config.moe.expert_dim * h)
    if MLP_DENSE in config.mlp_types:
        candidates.append(config.dense_mlp.intermediate_size * h)
    return max(candidates)


# ------------------------------------------------------------------------ per-token activations


def stored_input_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2, layer_inputs: str = "bf16") -> int:
    """What full recompute keeps per layer: the [n_streams, hidden] residual of each token, in the run's
    dtype, or with `layer_inputs="fp8"` one byte an element plus a float32 scale per stream (one row
    of hidden: genolong.train.fp8_rows)."""
    if layer_inputs == "fp8":
        return config.mhc.num_streams * (config.hidden + FP8_SCALE_BYTES)
    return config.mhc.num_streams * config.hidden * dtype_bytes


def _rmsnorm(dim: int, a: int) -> int:
    # The fp32 copy (saved by pow and by the rsqrt multiply), the normalised value in the input
    # dtype (saved by the weight multiply) and the output (saved by whatever reads it).
    return FP32 * dim + 2 * a * dim


def _hyper_connection(config: ModelConfig, a: int) -> dict[str, int]:
    """One mHC hyper-connection's saved tensors per token (its input streams are counted by the caller)."""
    n, iters = config.mhc.num_streams, config.mhc.sinkhorn_iters
    outs = (2 + n) * n
    # RMS statistic, the fp32 logits and their scaled copy; sigmoid outputs (pre, post), post,
    # the softmax output and comb before Sinkhorn; pre in the streams' dtype for the collapse.
    mixing = FP32 * 3 + 2 * FP32 * outs + FP32 * (3 * n + 2 * n * n) + a * n
    # Every Sinkhorn division keeps its numerator [n, n] and denominator [n] in fp32.
    sinkhorn = (2 * iters - 1) * FP32 * (n * n + n)
    return {"mhc mixing": mixing, "mhc sinkhorn": sinkhorn}


def _kda(config: ModelConfig, a: int) -> dict[str, int]:
    k = config.kda
    c, d, heads = k.qkv_dim, k.head_dim, k.num_heads
    return {
        # The depthwise conv runs in fp32 (its weight's dtype): its input and the SiLU's input.
        "kda conv (fp32)": 2 * FP32 * 3 * c,
        # f_a and g_a outputs; f + dt_bias and its sigmoid (fp32); beta.
        "kda gates": 2 * a * d + 2 * FP32 * c + a * heads,
        # What the op keeps of its inputs: q, k, v and the fp32 log decay g.
        "kda op inputs": 3 * a * c + FP32 * c,
        # Gated RMSNorm in fp32: x, x*rstd, weight*x*rstd, sigmoid(gate); then o_proj's input.
        "kda out norm": 4 * FP32 * c + a * c,
    }


def _kda_op_internals(config: ModelConfig, a: int) -> int:
    """fla chunk_kda's own saved tensors beyond its inputs: the q/k norms' rstd and Aqk, Akk.
    (Its normalised q and k replace the inputs q and k it does not keep.)

    Not itemised: inside a layer checkpoint it also keeps w, u, the gated q and k and v_new from
    the recompute to its backward (genolong.kernels.kda.fla_chunk; 5 KiB a token for glm53-mini, 2.5 GiB
    at 512k). On the H200 they did not move the measured peak (512k: 104.38 GiB before and after;
    128k +0.41 GiB; 2026-12-03), while this plan, already 24 GiB above that peak at 512k, would
    offload two more layers than the run that measured it if they were counted here. Count them
    when a run has measured the plan with them."""
    heads = config.kda.num_heads
    return 2 * FP32 * heads * KDA_CHUNK + 2 * FP32 * heads


def _dsa(config: ModelConfig, a: int) -> dict[str, int]:
    d = config.dsa
    ql, kvl, heads = d.q_lora_rank, d.kv_lora_rank, d.num_heads
    return {
        "dsa projections": _rmsnorm(ql, a) + a * heads * d.qk_head_dim + _rmsnorm(kvl, a),
        # absorbed q in the latent space and the op's output, then o_proj's input.
        "dsa latent q/out": 2 * a * heads * kvl + a * heads * d.v_head_dim,
        # The indexer's selection (int32) lives until the layer's backward has used it.
        "dsa top-k indices": 4 * d.indexer.width,
    }


def kept_bytes_per_token(config: ModelConfig, layer_idx: int, a: int = 2, tp: int = 1) -> int:
    """What recompute keeps of DSA layer `layer_idx` from its forward (genolong.train.keep), per
    token: the selection (int32 pool indices and tail slots, genolong.model.kept_selection; layers
    with an indexer; its 1/tp under tensor parallelism) and the sparse attention's output + lse (of
    the num_heads / tp heads one GPU runs)."""
    if config.layer_types[layer_idx] != LAYER_DSA:
        return 0
    d = config.dsa
    heads = d.num_heads // tp
    packed = d.indexer.topk_pools + (d.indexer.width - d.indexer.topk_pools * d.indexer.kpool)
    # Under tp the sequence-sharded indexer selects (and records) its 1/tp of the queries.
    selection = 4 * packed // tp if config.indexer_runs(layer_idx) else 0
    return selection + a * heads * d.kv_lora_rank + FP32 * heads


def _dsa_op_internals(config: ModelConfig, a: int) -> int:
    return FP32 * config.dsa.num_heads  # the log-sum-exp per head


def _moe(config: ModelConfig, a: int) -> dict[str, int]:
    """MoE saved bytes per token (the routed part is per routed copy, times top_k)."""
    m, h = config.moe, config.hidden
    k, inter = m.top_k, m.expert_dim
    # fp32 input copy, sigmoid scores, top-k indices (int64), the gathered and normalised weights.
    router = FP32 * h + FP32 * m.num_experts + 8 * k + 3 * FP32 * k
    # The grouped path (genolong.kernels.moe.grouped, the GPU's): the dispatched rows (the gate/up
    # GEMM's weight gradient reads them), gate/up (all the fused SwiGLU keeps), its output (the down
    # GEMM's), the expert output and the fp32 weight (the combine's); the sort order and token
    # indices (int64).
    routed = k * (a * (2 * h + 3 * inter) + FP32 + 2 * 8)
    # The shared expert is the eager DenseMLP: gate, up, clamp(gate), silu, clamp(up), product.
    shared = 6 * a * inter * m.num_shared_experts
    return {"moe router": router, "moe routed": routed, "moe shared": shared}


def _dense_mlp(config: ModelConfig, a: int) -> dict[str, int]:
    return {"dense mlp": 6 * a * config.dense_mlp.intermediate_size}


STREAMS_TWO_PATHS = "mhc streams' gradient, two paths"


def backward_peaks(config: ModelConfig, layer_idx: int, dtype_bytes: int = 2, moe_chunked: bool = False) -> dict[str, int]:
    """Bytes per token of the largest set of gradients one backward node of each part of layer
    `layer_idx` makes while the layer's saved items are still held (the working set's peak above
    them and the incoming gradient; the op workspaces are `_transients`). Measured on real-shape
    GLM-5.3-Flash sublayers (docs/parallel.md, "The per-layer figures against one GPU"): each
    part's working set is its saved items + the gradient coming in + the largest of these and its
    own workspace, within 5% for MLP, KDA and mHC.

    The streams' gradient runs along two paths of each hyper-connection (the residual and the mixing)
    and is held twice before they are summed; the MoE entry is absent when it runs in checkpointed
    chunks (its chunk's activations are then a transient)."""
    a = dtype_bytes
    peaks = {STREAMS_TWO_PATHS: 2 * stored_input_bytes_per_token(config, a)}
    if config.layer_types[layer_idx] == LAYER_KDA:
        # The depthwise conv in fp32: the gradients of its input and of the SiLU's input.
        peaks["kda conv gradients (fp32)"] = 2 * FP32 * 3 * config.kda.qkv_dim
    if config.mlp_types[layer_idx] == MLP_MOE:
        if not moe_chunked:
            # The fused SwiGLU's backward writes the gradient of gate/up for every routed copy.
            peaks["moe gate/up gradient"] = config.moe.top_k * a * 2 * config.moe.expert_dim
    else:
        # The SwiGLU product's two gradients (silu(gate) and clamp(up)).
        peaks["mlp swiglu gradients"] = 2 * a * config.dense_mlp.intermediate_size
    return peaks


def layer_saved_items(
    config: ModelConfig,
    layer_idx: int,
    dtype_bytes: int = 2,
    moe_chunked: bool = False,
    op_internals: bool = True,
    mhc_fp32_input: bool = False,
) -> dict[str, int]:
    """Bytes per token that layer `layer_idx` saves for backward, by item, without its input.

    moe_chunked: the MoE runs in checkpointed sequence chunks, so it saves nothing over the full
    sequence (its chunk's activations are a transient, see `transients`).
    op_internals: include what the fused KDA / DSA kernels keep beyond their inputs and outputs
    (left out by the CPU census test, whose stand-in ops keep only those).
    mhc_fp32_input: each hyper-connection keeps an fp32 copy of its input streams (the
    out-of-the-box form that the original recipe's no-needless-fp32 removed; MemoryOptions.mhc_low_precision=False).
    """
    a = dtype_bytes
    h, n = config.hidden, config.mhc.num_streams
    items: dict[str, int] = {}

    def add(part: dict[str, int]) -> None:
        for key, value in part.items():
            items[key] = items.get(key, 0) + value

    add(_hyper_connection(config, a))
    add({"norms": _rmsnorm(h, a) * 2})
    if config.layer_types[layer_idx] == LAYER_KDA:
        add(_kda(config, a))
        if op_internals:
            add({"kda op internals": _kda_op_internals(config, a)})
    else:
        add(_dsa(config, a))
        if op_internals:
            add({"dsa op internals": _dsa_op_internals(config, a)})
    # expand: post and comb in the streams' dtype, the sublayer's output; after the mixer also
    # the intermediate streams, which the second hyper-connection reads.
    add({"mixer out + streams": a * h + a * n + a * n * n + a * n * h})
    add(_hyper_connection(config, a))
    if config.mlp_types[layer_idx] == MLP_MOE:
        if not moe_chunked:
            add(_moe(config, a))
    else:
        add(_dense_mlp(config, a))
    add({"mlp out": a * h + a * n + a * n * n})
    if mhc_fp32_input and a < FP32:
        add({"mhc fp32 input copies": 2 * FP32 * n * h})
    return items


def layer_saved_bytes(
    config: ModelConfig,
    layer_idx: int,
    dtype_bytes: int = 2,
    moe_chunked: bool = False,
    op_internals: bool = True,
    mhc_fp32_input: bool = False,
) -> int:
    return sum(layer_saved_items(config, layer_idx, dtype_bytes, moe_chunked, op_internals, mhc_fp32_input).values())


# ------------------------------------------------------------------------------------ estimate


def _host_budget_bytes(opts: MemoryOptions, gpus_on_node: int, host_bytes: int | None) -> int:
    """Host RAM one GPU may fill: --host-budget-gib, else HOST_USABLE of its node's RAM shared by the node's GPUs."""
    if opts.host_budget_gib is not None:
        return int(opts.host_budget_gib * GIB)
    total = host_bytes if host_bytes is not None else _physical_ram()
    return int(total * HOST_USABLE / gpus_on_node)


def _physical_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 128 * GIB


def estimate_memory(
    model_config: ModelConfig,
    seq_len: int,
    opts: MemoryOptions | None = None,
    n_gpus: int = 1,
    gpu_bytes: int = H200_BYTES,
    *,
    batch: int = 1,
    dtype_bytes: int = 2,
    host_bytes: int | None = None,
    offload_layers: int | None = None,
    setup: ParallelSetup | None = None,
) -> MemoryEstimate:
    """The itemised per-GPU estimate of one training step (module docstring).

    batch: sequences in one micro-batch of one data-parallel rank. host_bytes: one node's RAM.
    setup: the parallel layout and its choices (genolong.train.plan_parallel); None plans `n_gpus`
    as it always has (cp=n_gpus, FSDP-style sharding). With a setup, n_gpus must be 1 or its world size.
    offload_layers: override opts.offload_layers; with both None and offload on, the smallest
    number of offloaded layers that fits `gpu_bytes * GPU_USABLE` (or opts.gpu_budget_gib).
    """
    config = model_config
    opts = opts or MemoryOptions()
    opts.validate()
    if setup is None:
        setup = single_gpu_setup(n_gpus)
    elif n_gpus not in (1, setup.world):
        raise GenolongError(f"--gpus {n_gpus} does not match --parallel {setup.layout} ({setup.world} GPUs); drop --gpus or make them agree")
    a = dtype_bytes
    t = tokens_per_gpu(seq_len, batch, setup.layout)
    tokens = t.seq  # what the per-token items are paid on (module genolong.train.plan_parallel)
    layers = config.num_layers
    gpu_budget = int(opts.gpu_budget_gib * GIB) if opts.gpu_budget_gib is not None else int(gpu_bytes * GPU_USABLE)

    gpu = static_per_gpu(config, setup, a)
    host: dict[str, int] = {}
    if setup.optimizer_on_host:
        host["optimizer state (fp32 masters + AdamW moments)"] = gpu.pop("optimizer state")
    if setup.sharded:
        gpu["fsdp gathered layer (weights + gradient)"] = fsdp_gathered_bytes(config, setup, a)
    stream_bytes = stored_input_bytes_per_token(config, a) * tokens
    # What each stored (kept or offloaded) layer input takes; the streams' gradients stay whole.
    stored_bytes = stored_input_bytes_per_token(config, a, opts.layer_inputs) * tokens
    fp32_hc = not opts.mhc_low_precision
    moe_chunked = moe_chunks_checkpointed(tokens, opts)
    moe_routed = _moe(config, a)["moe routed"] if config.moe_layers else 0
    # Sequence tiling (genolong.train.tiling; one GPU): a layer's working set is one tile's.
    tile = opts.tiles_at(tokens) if setup.world == 1 else None
    work_tokens = tile or tokens
    items = []
    for i in range(layers):
        per_token = layer_saved_items(config, i, a, moe_chunked, mhc_fp32_input=fp32_hc)
        layer = {k: v * work_tokens for k, v in per_token.items()}
        layer.update(layer_parallel_items(config, i, setup, t, a, moe_chunked, moe_routed))
        items.append(layer)
    per_layer = [sum(it.values()) for it in items]
    # Backward of a layer: its saved activations, the streams' gradient coming in, and the largest
    # set of gradients one of its nodes makes meanwhile (`backward_peaks`: the streams' gradient
    # along the hyper-connection's two paths, or a part's own).
    # Tiled, the streams' gradient is the whole incoming one plus a tile's (a tiled layer's input
    # gradient is assembled from its tiles').
    streams_per_token = stored_input_bytes_per_token(config, a)
    peak = []
    for i in range(layers):
        parts = {k: v * work_tokens for k, v in backward_peaks(config, i, a, moe_chunked).items()}
        parts[STREAMS_TWO_PATHS] = streams_per_token * (tokens + work_tokens)
        peak.append(max(parts.values()))

    transients = _transients(config, t if tile is None else dataclasses.replace(t, shard=tile, seq=tile), opts, a, setup)
    # The MoE chunk's activations exist only while its chunk is recomputed; the rest are
    # kernel workspaces that come and go inside one op.
    transient_name = max(transients, key=transients.get)

    loss_items = _loss_head(config, t, opts, a)
    # (over the cp shard: a tp rank attends with its heads for every token of the shard)
    kept_gpu = _kept_results(config, t.shard, opts, a, host, setup.layout.tp, t.seq, in_flight_tokens=tile)
    kept_gpu.update(_kept_routes(config, t.seq, opts, host))
    tiled_gpu = _tiling_items(config, tokens, tile, a) if tile else {}

    if opts.recompute:
        if offload_layers is None:
            offload_layers = opts.offload_layers if opts.offload else 0
        # fp8 storage: the input of the layer (under tiling, the tile) being recomputed is rebuilt in the
        # run's dtype beside its stored form, for that layer's recompute and backward.
        rebuilt = {"rebuilt layer input (fp8 storage)": stored_input_bytes_per_token(config, a) * work_tokens} if opts.layer_inputs == "fp8" else {}
        fixed = (sum(gpu.values()) + transients[transient_name] + sum(loss_items.values()) + sum(kept_gpu.values()) + sum(tiled_gpu.values())
                 + sum(rebuilt.values()))
        # The streams' gradient coming in is a whole-sequence tensor even under tiling; a tiled DSA
        # layer also accumulates its whole latent's gradient over the query tiles.
        keys_grad = [2 * a * config.dsa.kv_lora_rank * tokens if tile and config.layer_types[i] == LAYER_DSA else 0 for i in range(layers)]
        grad_in = streams_per_token * tokens
        working = [per_layer[i] + grad_in + peak[i] + keys_grad[i] for i in range(layers)]
        # An offloaded tiled layer's input comes back tile by tile (its own and the next prefetched).
        upload = stored_input_bytes_per_token(config, a, opts.layer_inputs) * tile if tile else None
        if offload_layers is None:  # offload on, count from the budget
            offload_layers = offload_layers_needed(fixed, stored_bytes, working, gpu_budget, overlap=opts.offload_overlap, upload_bytes=upload)
        offload_layers = min(offload_layers, layers) if opts.offload else 0
        stored, prefetch, at = recompute_peak(stored_bytes, working, offload_layers, opts.offload_overlap, upload_bytes=upload)
        gpu["stored layer inputs"] = stored
        if prefetch:
            gpu["uploaded layer inputs"] = prefetch
        gpu.update(rebuilt)
        gpu[f"layer working set (recompute, layer {at})"] = working[at]
    else:
        offload_layers = 0
        # Every layer's saved activations, and each layer keeps its own input streams.
        gpu["activations (no recompute)"] = sum(per_layer) + layers * stream_bytes
        gpu["backward gradients"] = max(peak) + streams_per_token * tokens
    gpu.update(loss_items)
    gpu[f"largest transient ({transient_name})"] = transients[transient_name]
    gpu.update(kept_gpu)
    gpu.update(tiled_gpu)

    offloaded = {"offloaded layer inputs (pinned)" if opts.offload_pinned else "offloaded layer inputs (pageable)": offload_layers * stored_bytes}
    return MemoryEstimate(
        seq_len=seq_len,
        n_gpus=setup.world,
        tokens_per_gpu=tokens,
        gpu=gpu,
        host={**offloaded, **host},
        transients=transients,
        offload_layers=offload_layers,
        gpu_bytes=gpu_budget,
        host_bytes=_host_budget_bytes(opts, setup.gpus_on_node, host_bytes),
        opts=opts,
        setup=setup,
    )


def estimate_cpu_memory(
    model_config: ModelConfig,
    seq_len: int,
    opts: MemoryOptions | None = None,
    *,
    batch: int = 1,
    dtype_bytes: int = FP32,
    ram_bytes: int | None = None,
) -> MemoryEstimate:
    """A CPU run's RAM, itemised like a GPU's (in `gpu`), against `opts.host_budget_gib` or
    HOST_USABLE of the machine's RAM (`ram_bytes`, default this machine's)."""
    opts = opts or MemoryOptions()
    opts.validate()
    if opts.host_budget_gib is not None:
        budget = int(opts.host_budget_gib * GIB)
    else:
        budget = int((ram_bytes if ram_bytes is not None else _physical_ram()) * HOST_USABLE)
    # Offload copies into the same RAM: plan the inputs as kept, against the RAM budget.
    # (kept DSA results in host memory are in the same RAM: plan them as kept on the "device")
    keep = "device" if opts.keep_sparse == "host" else opts.keep_sparse
    kept = MemoryOptions.from_dict({**opts.to_dict(), "offload": False, "offload_layers": None, "gpu_budget_gib": budget / GIB,
                                    "keep_sparse": keep})
    est = estimate_memory(model_config, seq_len, kept, 1, budget, batch=batch, dtype_bytes=dtype_bytes, host_bytes=budget)
    static = sum(static_bytes(model_config, dtype_bytes).values())
    est.gpu["reference ops (CPU)"] = int((CPU_REFERENCE_FACTOR - 1) * (est.gpu_total - static))
    est.device = "cpu"
    est.host = {}
    est.opts = opts
    return est


def _tiling_items(config: ModelConfig, tokens: int, tile: int, a: int) -> dict[str, int]:
    """What a tiled run holds on the GPU from each layer's forward to its backward beyond its input
    (genolong.train.tiling): every DSA layer's whole-sequence latent and pooled indexer keys, and
    every KDA layer's carried state (fp32) and conv tail at each tile boundary."""
    d, k = config.dsa, config.kda
    n_dsa = len(config.dsa_layers)
    n_kda = sum(t == LAYER_KDA for t in config.layer_types)
    keys = n_dsa * tokens * a * (d.kv_lora_rank + d.indexer.head_dim / d.indexer.kpool)
    boundaries = -(-tokens // tile) - 1
    carries = n_kda * boundaries * (FP32 * k.num_heads * k.head_dim * k.head_dim + a * 3 * k.qkv_dim * (k.conv_kernel - 1))
    return {"dsa whole-sequence keys (tiling)": int(keys), "kda carried states (tiling)": int(carries)}


def _kept_results(config: ModelConfig, tokens: int, opts: MemoryOptions, a: int, host: dict[str, int], tp: int, moe_tokens: int,
                  in_flight_tokens: int | None = None) -> dict[str, int]:
    """The GPU items of what recompute keeps from the forward (genolong.train.keep: the DSA results
    over `tokens`, and with keep_moe each chunked MoE layer's output over `moe_tokens`, the MoE's
    tokens per GPU); adds the host's. `in_flight_tokens`: under tiling the results come back per
    tile, so two tiles' are on the GPU at once instead of two layers'."""
    where = opts.kept_where()
    layers = range(config.num_layers)
    dsa = [kept_bytes_per_token(config, i, a, tp) * tokens if where else 0 for i in layers]
    moe_kept = opts.keeps_moe() and moe_chunks_checkpointed(moe_tokens, opts)
    if moe_kept:
        where = where or opts.kept_moe_where()
    moe = [a * config.hidden * moe_tokens if moe_kept and config.mlp_types[i] == MLP_MOE else 0 for i in layers]
    if where == "device":
        # All alive at the backward of the last layer that keeps (freed layer by layer after it).
        out = {"kept DSA results (device)": sum(dsa)} if opts.kept_where() else {}
        return {**out, **({"kept MoE outputs (device)": sum(moe)} if moe_kept else {})}
    if where == "host":
        if opts.kept_where():
            host["kept DSA results (pinned)"] = sum(dsa)
        if moe_kept:
            host["kept MoE outputs (pinned)"] = sum(moe)
        # A layer's own and the next one's (prefetched) are on the GPU during its recompute.
        name = "kept DSA results and MoE outputs" if moe_kept and opts.kept_where() else "kept MoE outputs" if moe_kept else "kept DSA results"
        two = sum(sorted(d + m for d, m in zip(dsa, moe))[-2:])
        if in_flight_tokens:
            return {f"{name} in flight (2 tiles)": two * in_flight_tokens // max(tokens, 1)}
        return {f"{name} in flight (2 layers)": two}
    return {}


def kept_route_bytes_per_token(config: ModelConfig) -> int:
    """What fp8 layer-input storage keeps of each MoE layer for its recompute, per token: the forward's
    top-k expert indices in the smallest integer type holding the expert count (genolong.model.moe)."""
    from genolong.model.moe import index_dtype

    return config.moe.top_k * index_dtype(config.moe.num_experts).itemsize if config.moe_layers else 0


def _kept_routes(config: ModelConfig, moe_tokens: int, opts: MemoryOptions, host: dict[str, int]) -> dict[str, int]:
    """The router choices fp8 storage keeps (router replay), all MoE layers', where the DSA results
    wait (the device when nothing else is kept); parked ones add the host item (the two layers' in
    flight on the GPU, a few MiB at 1M, are left out)."""
    if not (opts.recompute and opts.layer_inputs == "fp8"):
        return {}
    total = kept_route_bytes_per_token(config) * moe_tokens * len(config.moe_layers)
    if (opts.kept_where() or opts.kept_moe_where()) == "host":
        host["kept router choices (pinned)"] = total
        return {}
    return {"kept router choices (device)": total}


def recompute_peak(stream_bytes: int, working: list[int], offloaded: int, overlap: bool = True,
                   upload_bytes: int | None = None) -> tuple[int, int, int]:
    """(stored inputs, uploaded inputs, layer) at the backward peak under full recompute.

    Backward visits the layers last to first; while layer i recomputes, the inputs of the kept
    layers 0..i are still stored (those above i are freed), and the input of the next offloaded
    layer below i is already being uploaded (with overlap). The first `offloaded` layers offload.
    upload_bytes: what one upload brings back (a layer's input; under tiling a tile's).
    """
    up = stream_bytes if upload_bytes is None else upload_bytes
    best = None
    for i in range(len(working)):
        if i >= offloaded:
            stored = (i + 1 - offloaded) * stream_bytes
            uploaded = up if overlap and offloaded else 0
        else:
            # An offloaded layer's own input is back on the GPU, and the next one is on its way.
            stored = 0
            uploaded = up * (1 + (1 if overlap and (i >= 1 or upload_bytes is not None) else 0))
        total = stored + uploaded + working[i]
        if best is None or total > best[0]:
            best = (total, stored, uploaded, i)
    return best[1], best[2], best[3]


def offload_layers_needed(fixed: int, stream_bytes: int, working: list[int], budget: int, overlap: bool = True,
                          upload_bytes: int | None = None) -> int:
    """Fewest (first) layers whose inputs must leave the GPU for the backward peak to fit `budget`."""
    for n in range(len(working) + 1):
        stored, prefetch, at = recompute_peak(stream_bytes, working, n, overlap, upload_bytes)
        if fixed + stored + prefetch + working[at] <= budget:
            return n
    return len(working)


def moe_chunks_checkpointed(tokens: int, opts: MemoryOptions) -> bool:
    """Whether the MoE runs as checkpointed chunks at this many tokens per GPU: only when the
    sequence is longer than one chunk (genolong.train.memory runs a single chunk as the plain
    MoE, which saves its activations like any layer; the H200 ablation without recompute at 32k
    measured those 35 GiB when the plan still assumed chunking)."""
    # (under tiling no MoE is chunked, genolong.train.memory: a tile's MoE runs whole)
    return opts.moe_chunking and tokens > opts.moe_chunk_tokens and not (opts.recompute and opts.tile_tokens is not None)


def _transients(config: ModelConfig, t: Tokens, opts: MemoryOptions, a: int, setup: ParallelSetup) -> dict[str, int]:
    """Workspaces that live inside one op (the largest is counted). `t`: tokens per GPU (the
    whole sequences, the cp shard, the sequence-parallel part; all equal on one GPU)."""
    out: dict[str, int] = {}
    h, lay = config.hidden, setup.layout
    if config.dsa_layers:
        ix = config.dsa.indexer
        pools = t.whole // ix.kpool
        # The fused paths' per-query bytes, the larger of v1's (genolong.kernels.indexer.topk.indexer_two_pass:
        # group maxima and their top-k copy, candidate scores, top-k values/indices, outputs) and
        # v2's (indexer_fused_select: twice the group maxima at its smaller groups, the candidate
        # scratch); which one runs depends on the head count. Each rank scores only its own
        # queries (Ts), against the pools of the whole sequence, whose keys it gathers from the other ranks.
        v1 = -(-pools // INDEXER_GROUP) * 8 + ix.topk_pools * (INDEXER_GROUP * 4 + 24) + ix.width * 8
        v2 = -(-pools // INDEXER_V2_GROUP) * 8 + ix.topk_pools * (INDEXER_V2_GROUP * 4 + 16)
        per_query = max(v1, v2)
        gathered_keys = (t.whole - t.seq) // ix.kpool * ix.head_dim * a
        out["indexer query chunk"] = min(t.seq * per_query, INDEXER_BUDGET) + gathered_keys
        # The sparse attention's backward (genolong.kernels.sparse_mla.op._backward) on this rank's
        # heads: the gradient of its output coming in, dq and the fp32 row statistic for every query,
        # the fp32 dkv over every kv row it reads (the gathered latent under cp), and, when the keys
        # span several key chunks, one query chunk's sort, slot ranges and fp32 dq, sized to the
        # kernel's budget; less the output projection's input, which that projection's backward,
        # run before, has freed (one of the layer's items).
        d = config.dsa
        heads, dim = d.num_heads // lay.tp, d.kv_lora_rank
        n_chunks = math.ceil(t.whole / sparse_mla.KEY_CHUNK)
        row_bytes = sparse_mla.backward_row_bytes(ix.width, heads, dim, n_chunks)
        query_chunk = min(t.shard * row_bytes, sparse_mla.QUERY_BUDGET_BYTES) if n_chunks > 1 else 0
        per_query = heads * (2 * a * dim + FP32) - heads * a * d.v_head_dim
        out["dsa attention workspace"] = t.shard * per_query + FP32 * dim * t.whole + query_chunk
    if LAYER_KDA in config.layer_types:
        k = config.kda
        # fla's per-chunk states h [T/64, H, Dk, Dv] fp32, and their gradient in backward: the cp
        # shard with this tp rank's heads; Ulysses: the whole sequence with H / (tp cp) heads;
        # state passing computes Dv + Dk columns (the shard's transition beside its states).
        if lay.cp > 1 and setup.kda_mode == "ulysses":
            chunks, heads, width = math.ceil(t.whole / KDA_CHUNK), k.num_heads // (lay.tp * lay.cp), k.head_dim
        else:
            chunks, heads, width = math.ceil(t.shard / KDA_CHUNK), k.num_heads // lay.tp, k.head_dim * (2 if lay.cp > 1 else 1)
        out["kda chunk states"] = 2 * FP32 * chunks * heads * k.head_dim * width
    if config.moe_layers:
        m = config.moe
        moe = _moe(config, a)
        # The busiest ep rank receives moe_skew x the mean rows (real routing is uneven).
        skew = setup.moe_skew if lay.ep > 1 else 1.0
        if moe_chunks_checkpointed(t.seq, opts):
            chunk = opts.moe_chunk_tokens
            rows = int(chunk * (moe["moe router"] + moe["moe shared"] + skew * moe["moe routed"]))
            # One process: an fp32 combine buffer; under ep the rows' copies at home (no fp32 combine).
            combine = chunk * m.top_k * FP32 * h if lay.ep == 1 else dispatch_bytes(config, setup, chunk, a)
            out["moe chunk"] = rows + combine
        elif lay.ep == 1:
            # The op's own chunk: the fp32 weighted copy of its outputs before the combine.
            out["moe op chunk"] = min(t.seq * m.top_k * FP32 * h, MOE_OP_BUDGET)
        # When the op runs its tokens in more than one chunk (grouped.chunk_tokens_for), autograd adds each
        # chunk's weight gradients for this rank's experts to running sums that become the parameters'
        # gradients only after the last chunk (tests/train/test_backward_peak.py): both sums (gate/up
        # and down) are held while the newest chunk's gate/up gradient is made. (The 36-expert cells:
        # 2.3 GiB above their per-token part at 64k and 128k; the 288-expert cell: 26 GiB.)
        # (A tiled layer runs its MoE once per tile: the same sums.)
        if t.seq > moe_grouped.chunk_tokens_for(m.top_k, h, m.expert_dim, a) or opts.tiles_at(t.whole) is not None:
            gate_up, down = 2 * m.expert_dim * h, m.expert_dim * h
            out["moe expert weight gradients (chunk sums)"] = a * (m.num_experts // lay.ep) * (2 * gate_up + down)
    if lay.cp > 1 and setup.kda_mode == "ulysses" and LAYER_KDA in config.layer_types:
        out["kda partial output (cp, ulysses)"] = t.whole * h * a  # [T, hidden] before its reduce-scatter
    return out


def _loss_head(config: ModelConfig, t: Tokens, opts: MemoryOptions, a: int) -> dict[str, int]:
    """Each rank computes the loss of its cp shard (Tc; under tp every rank repeats it on the
    gathered shard, genolong.parallel.tensor)."""
    h, v = config.hidden, config.vocab_size
    # final mHC mean and final RMSNorm (fp32 copies) on the rank's tokens; the normed hidden
    # (gathered over tp) saved by the loss, and its per-token fp32 statistics.
    common = t.seq * (a * h + _rmsnorm(h, a)) + (t.shard - t.seq) * a * h + t.shard * FP32 * 2
    tokens = t.shard
    if opts.chunked_loss:
        chunk = min(tokens, opts.loss_chunk_tokens or auto_chunk_tokens(v))
        # One chunk's fp32 logits and their gradient, plus the fp32 weight-gradient accumulator.
        return {"loss head": common + 2 * chunk * v * FP32 + v * h * FP32}
    # [T, vocab] logits in the model dtype, their fp32 copy, and its gradient.
    return {"loss head (full logits)": common + tokens * v * (a + 2 * FP32)}


# ----------------------------------------------------------------------------------- tile choice

# `--tile auto` tries these, longest first (fewer tiles: less per-tile overhead).
TILE_CHOICES = (1 << 19, 1 << 18, 1 << 17, 1 << 16, 1 << 15)


def choose_tile(model_config: ModelConfig, seq_len: int, opts: MemoryOptions, n_gpus: int = 1, gpu_bytes: int = H200_BYTES,
                **kw) -> MemoryEstimate | None:
    """The estimate with the longest tile of TILE_CHOICES (shorter than the sequence) that fits, its
    `opts` a copy with that tile_tokens (and, where `--keep-sparse auto` keeps the DSA results and
    only dropping them fits, keep_sparse "off"); None when none fits (or the run cannot tile: no
    recompute, several GPUs)."""
    if not opts.recompute or n_gpus != 1 or kw.get("setup") is not None and kw["setup"].world != 1:
        return None
    keeps = [opts.keep_sparse] + (["off"] if opts.keep_sparse == "auto" and opts.kept_where() else [])
    for tile in TILE_CHOICES:
        if tile >= seq_len:
            continue
        for keep in keeps:
            trial = dataclasses.replace(opts, tile_tokens=tile, keep_moe=False, keep_sparse=keep)
            est = estimate_memory(model_config, seq_len, trial, n_gpus, gpu_bytes, **kw)
            if est.fits:
                return est
    return None
