"""What a training run is told: `TrainOptions` (the loop) and `MemoryOptions` (how it saves memory).

Both are plain dataclasses that round-trip through JSON (`to_dict` / `from_dict`): the run
directory keeps `options.json` so that `--resume` rebuilds exactly the same run, and the launcher
ships them to a worker process or a Ray actor as dicts.

`MemoryOptions` is read by genolong.train.memory (recompute, offload, MoE chunking, mHC input
precision) and by the pre-flight estimate; every optimization has its own switch so that the
ablation table can remove one at a time, and `MemoryOptions.baseline()` removes all of them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from genolong.errors import GenolongError
from genolong.units import parse_length

KERNEL_CHOICES = ("auto", "fused", "reference")
LAUNCHERS = ("local", "ray")
KEEP_CHOICES = ("auto", "host", "device", "off")
LAYER_INPUT_CHOICES = ("bf16", "fp8")


@dataclass
class MemoryOptions:
    """Memory optimizations (the original recipe's recompute, offload, no-needless-fp32 and MoE chunking and the chunked loss head).

    recompute: full-layer activation recompute (each layer keeps only its input for backward).
    offload: move each recomputed layer's stored input to pinned host memory.
    offload_layers: how many layers offload; None = as many as the GPU budget requires.
    offload_pinned: pinned (page-locked) host buffers; False = pageable (slower copies; ablation).
    offload_overlap: copies on their own CUDA streams, overlapped with compute.
    keep_sparse: under recompute, keep the DSA layers' selections and sparse-attention results from
      the forward for the recompute (genolong.train.keep): "host" (pinned host memory), "device",
      "off" (recompute them), "auto" (host with offload on, else device).
    moe_chunking: run MoE layers over the sequence in chunks of `moe_chunk_tokens` tokens.
    keep_moe: under recompute with moe_chunking, keep each MoE layer's output from the forward for
      the recompute (genolong.train.keep_moe): two MoE forwards a step instead of three, for hidden
      x 2 bytes a token and MoE layer where keep_sparse keeps (opt-in: -0.14 s of a 128k step on an H100,
      +21 GiB pinned at 512k, where it has not run).
    mhc_low_precision: mHC mixing projection without an fp32 copy of its input.
    chunked_loss: LM head + loss in chunks of `loss_chunk_tokens` (no [T, vocab] logits).
    tile_tokens: under recompute, every layer runs the sequence in checkpointed tiles of this many
      tokens (genolong.train.tiling; its MoE per tile, so MoE chunking and keep_moe do not apply);
      None = whole layers. tile_auto: the CUDA pre-flight picks tile_tokens when the untiled plan
      does not fit (`--tile auto`).
    layer_inputs: how recompute stores each layer's input between forward and backward (on the GPU
      or offloaded): "bf16" as it is (exact; in the run's dtype), "fp8" as float8_e4m3fn with one
      fp32 scale per row of hidden (about half the bytes; lossy: backward's recompute runs on the
      rebuilt input; genolong.train.offload).
    gpu_budget_gib / host_budget_gib: the pre-flight's limits; None = the device's / machine's.
    """

    recompute: bool = True
    offload: bool = True
    offload_layers: int | None = None
    offload_pinned: bool = True
    offload_overlap: bool = True
    keep_sparse: str = "auto"
    moe_chunking: bool = True
    moe_chunk_tokens: int = 65536
    keep_moe: bool = False
    mhc_low_precision: bool = True
    chunked_loss: bool = True
    loss_chunk_tokens: int | None = None  # None = ~1 GiB of fp32 logits per chunk (loss.auto_chunk_tokens)
    tile_tokens: int | None = None
    tile_auto: bool = False
    layer_inputs: str = "bf16"
    gpu_budget_gib: float | None = None
    host_budget_gib: float | None = None

    @classmethod
    def baseline(cls, **overrides: Any) -> MemoryOptions:
        """The stack as it would run out of the box: every optimization off."""
        off = {
            "recompute": False,
            "offload": False,
            "offload_pinned": False,
            "offload_overlap": False,
            "keep_sparse": "off",
            "moe_chunking": False,
            "mhc_low_precision": False,
            "chunked_loss": False,
        }
        off.update(overrides)
        return cls(**off)

    @classmethod
    def from_flags(cls, baseline: bool, *, recompute: bool, offload: bool, moe_chunk: str, loss_chunk: str | None,
                   offload_layers: int | None, gpu_budget_gib: float | None, host_budget_gib: float | None,
                   tile: str = "off", **switches: Any) -> MemoryOptions:
        """The options `finetune` and `plan` build from their shared memory flags.

        --baseline turns every switch off and keeps only the sizes and budgets; otherwise
        --no-recompute also turns offload off (offload moves the layer inputs recompute keeps).
        """
        sizes = {
            "offload_layers": offload_layers,
            "moe_chunk_tokens": parse_length(moe_chunk, "--moe-chunk"),
            "loss_chunk_tokens": parse_length(loss_chunk, "--loss-chunk") if loss_chunk else None,
            "gpu_budget_gib": gpu_budget_gib,
            "host_budget_gib": host_budget_gib,
        }
        if baseline:
            # (an fp8 request is kept so that validate refuses it: --baseline has no recompute)
            inputs = {"layer_inputs": switches["layer_inputs"]} if switches.get("layer_inputs", "bf16") != "bf16" else {}
            return cls.baseline(**sizes, **inputs).validate()
        tile_tokens, tile_auto = parse_tile(tile)
        return cls(recompute=recompute, offload=offload and recompute, tile_tokens=tile_tokens, tile_auto=tile_auto and recompute,
                   **switches, **sizes).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryOptions:
        return cls(**_known(cls, d))

    def validate(self) -> MemoryOptions:
        if self.offload and not self.recompute:
            # Offload moves the per-layer input that full recompute keeps; without recompute every
            # intermediate activation stays on the GPU and there is no single input to move.
            raise GenolongError("--offload needs recompute (it offloads the layer inputs recompute keeps); drop --no-recompute or add --no-offload")
        if self.keep_sparse not in KEEP_CHOICES:
            raise GenolongError(f"--keep-sparse must be one of {', '.join(KEEP_CHOICES)}, got {self.keep_sparse!r}")
        if self.keep_sparse == "host" and not self.offload:
            raise GenolongError("--keep-sparse host parks results in the offload's pinned host pool: add --offload or use --keep-sparse device / off")
        if self.layer_inputs not in LAYER_INPUT_CHOICES:
            raise GenolongError(f"--layer-inputs must be one of {', '.join(LAYER_INPUT_CHOICES)}, got {self.layer_inputs!r}")
        if self.layer_inputs == "fp8" and not self.recompute:
            raise GenolongError("--layer-inputs fp8 stores the layer inputs that recompute keeps, and without recompute there are none: "
                                "drop --no-recompute / --baseline or --layer-inputs fp8")
        if self.keep_moe and not (self.recompute and self.moe_chunking):
            raise GenolongError("--keep-moe keeps the MoE output for the layers' recompute of its chunks: it needs recompute and --moe-chunking; drop --keep-moe")
        if self.tile_tokens is not None:
            if self.tile_tokens <= 0:
                raise GenolongError(f"--tile must be a positive number of tokens, auto or off, got {self.tile_tokens}")
            if not self.recompute:
                raise GenolongError("--tile runs each layer in checkpointed tiles, which is how it recomputes: drop --no-recompute or use --tile off")
            if self.keep_moe:
                raise GenolongError("--keep-moe keeps a chunked MoE's output, and under --tile the MoE runs per tile, unchunked: drop --keep-moe or use --tile off")
        if self.offload_layers is not None and self.offload_layers < 0:
            raise GenolongError(f"--offload-layers must be >= 0, got {self.offload_layers}")
        for flag, value in (("--moe-chunk", self.moe_chunk_tokens), ("--loss-chunk", self.loss_chunk_tokens)):
            if value is not None and value <= 0:
                raise GenolongError(f"{flag} must be a positive number of tokens, got {value}")
        for flag, value in (("--gpu-budget-gib", self.gpu_budget_gib), ("--host-budget-gib", self.host_budget_gib)):
            # `not value > 0` also catches NaN; inf would pass it and overflow the byte counts later.
            if value is not None and not (math.isfinite(value) and value > 0):
                raise GenolongError(f"{flag} must be a positive number of GiB, got {value}")
        return self

    def check_layers(self, num_layers: int) -> MemoryOptions:
        """Refuse an --offload-layers the model cannot take (it would be clamped: a typo goes unnoticed)."""
        if self.offload and self.offload_layers is not None and self.offload_layers > num_layers:
            raise GenolongError(
                f"--offload-layers {self.offload_layers}: the model has {num_layers} layers; pass at most {num_layers}, "
                "or leave it unset to offload as many as the GPU budget needs"
            )
        return self

    def tiles_at(self, tokens: int) -> int | None:
        """The tile length layers run in at `tokens` tokens per sequence, or None (whole layers)."""
        if self.recompute and self.tile_tokens is not None and tokens > self.tile_tokens:
            return self.tile_tokens
        return None

    def keeps_moe(self) -> bool:
        """Whether the chunked MoE layers' outputs are kept for the recompute (genolong.train.keep_moe)."""
        return self.keep_moe and self.recompute and self.moe_chunking

    def kept_moe_where(self) -> str | None:
        """Where the kept MoE outputs wait: with the DSA results, or (keep_sparse off) where "auto" would
        put those; None when they are not kept."""
        if not self.keeps_moe():
            return None
        return self.kept_where() or ("host" if self.offload else "device")

    def kept_where(self) -> str | None:
        """Where recompute keeps the DSA results ("host" / "device"), or None (recomputed)."""
        if not self.recompute or self.keep_sparse == "off":
            return None
        if self.keep_sparse == "auto":
            return "host" if self.offload else "device"
        return self.keep_sparse


def parse_tile(value: str | int | None) -> tuple[int | None, bool]:
    """--tile: a length ("128k"), "auto" (the pre-flight picks one when whole layers do not fit) or
    "off" -> (tile_tokens, tile_auto)."""
    if value is None or value == "off":
        return None, False
    if value == "auto":
        return None, True
    return parse_length(value, "--tile"), False


@dataclass
class TrainOptions:
    """One fine-tuning run. Lengths are token counts (parse "512k" with genolong.units first)."""

    data: str | None = None
    out: str | None = None
    seq_len: int = 524288
    preset: str | None = "glm53-mini"
    model_path: str | None = None  # a transformers-format checkpoint to start from (overrides preset)
    layers: int | None = None  # the preset's layer dial (None: the preset's own count); with --preset only
    steps: int = 80
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    warmup: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    batch: int = 1  # sequences per optimizer step
    grad_accum: int = 1  # micro-batches the step's `batch` sequences are processed in
    seed: int = 0
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    kernels: str | None = None  # None = fused on CUDA, reference on CPU (genolong.train.resolve)
    device: str | None = None  # None = cuda if available, else cpu
    dtype: str | None = None  # None = bfloat16 on CUDA, float32 on CPU
    split: str = "train"
    max_n_fraction: float = 0.1
    reverse_complement: bool = True
    overfit: int = 0  # > 0: train repeatedly on the first `overfit` windows
    planted_repeats: str | None = None  # e.g. "len=64,max-dist=48k,per-window=8" (genolong.data.planted); None = off
    max_nonfinite: int = 5  # stop after this many consecutive non-finite steps
    stop_after: int | None = None  # end this invocation after N steps (checkpointed; resume later)
    resume: bool = False  # continue the run in `out` from its latest complete checkpoint
    overwrite: bool = False  # replace an earlier run in `out` (a genolong run or an empty directory)
    launcher: str = "local"
    ray_address: str | None = None
    # The parallel layout "dp=2,cp=2,tp=1,ep=1" (genolong.parallel.layout); None: one process, or
    # dp = the number of processes torchrun started. A resume may change it (docs/parallel.md).
    parallel: str | None = None
    dist_timeout_s: float = 1800.0  # how long a collective waits for a rank before the run fails
    progress: bool = True
    tensorboard: bool = True
    # torch.compile the small ops (norms, router, SwiGLU; mHC off the GPU; genolong.train.compile).
    # None: on where the fused kernels run on CUDA (H200, 2026-12-02: -9.7% a step at 128k, -7.1%
    # at 512k, lower peak), off elsewhere (on the CPU it costs minutes of compilation for little).
    compile: bool | None = None
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    balance_rate: float = 1e-3  # expert-bias step per optimizer step (DeepSeek-V3's gamma); 0 = off
    aux_loss_coeff: float = 0.0  # sequence-wise expert balance loss (DeepSeek-V3 eq. 17-20); 0 = off
    repeat_weight: float = 1.0  # loss weight of soft-masked (repeat) target bases; Evo 2 uses 0.1
    # The DSA indexer (genolong/train/indexer.py): 0 keeps it frozen, > 0 trains it with its KL loss
    # at this weight; the first `indexer_warmup_steps` steps train only the indexer, against dense
    # attention; every `indexer_recall_every` steps (0: never) log its recall on sampled queries.
    indexer_loss_coeff: float = 0.0
    indexer_warmup_steps: int = 0
    indexer_recall_every: int = 0
    indexer_recall_queries: int = 256
    # The share of query blocks the sparse KL scores, drawn per step and layer (1: every query;
    # genolong.model.indexer_loss.scored_blocks): the loss's per-query cost at a fraction.
    indexer_loss_queries: float = 1.0
    # The model's indexer top-k for this run (None: the model's own); the saved model keeps it.
    indexer_topk: int | None = None
    # The copy curriculum (genolong/train/copy_oracle.py): k-mer length of the selection oracle; 0 = off.
    copy_oracle: int = 0

    @property
    def micro_batch(self) -> int:
        return self.batch // self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainOptions:
        d = _known(cls, d)
        if isinstance(d.get("memory"), dict):
            d["memory"] = MemoryOptions.from_dict(d["memory"])
        return cls(**d)

    def validate(self) -> TrainOptions:
        """Reject impossible settings before anything is loaded (one line: problem, then fix)."""
        if self.seq_len < 2:
            raise GenolongError(f"--seq must be at least 2 tokens, got {self.seq_len}")
        if self.steps <= 0:
            raise GenolongError(f"--steps must be positive, got {self.steps}")
        if self.batch <= 0 or self.grad_accum <= 0:
            raise GenolongError(f"--batch and --grad-accum must be positive, got {self.batch} and {self.grad_accum}")
        if self.batch % self.grad_accum:
            raise GenolongError(
                f"--batch {self.batch} is not divisible by --grad-accum {self.grad_accum}: the step's sequences are "
                "split into grad-accum equal micro-batches; pick a divisor"
            )
        for flag, value in (("--lr", self.lr), ("--grad-clip", self.grad_clip), ("--weight-decay", self.weight_decay),
                            ("--min-lr-ratio", self.min_lr_ratio)):
            if not math.isfinite(value):
                raise GenolongError(f"{flag} must be a finite number, got {value}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise GenolongError(f"--grad-clip and --weight-decay must be >= 0 (0 = off), got {self.grad_clip} and {self.weight_decay}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise GenolongError(f"--lr must be positive and min_lr_ratio in [0, 1], got {self.lr} and {self.min_lr_ratio}")
        if self.warmup < 0:
            raise GenolongError(f"--warmup must be >= 0, got {self.warmup}")
        if self.kernels is not None and self.kernels not in KERNEL_CHOICES:
            raise GenolongError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.launcher not in LAUNCHERS:
            raise GenolongError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.overfit < 0 or self.save_every < 0 or self.keep_last < 1:
            raise GenolongError("--overfit and --save-every must be >= 0 and --keep-last >= 1")
        if self.stop_after is not None and self.stop_after <= 0:
            raise GenolongError(f"--stop-after must be positive, got {self.stop_after}")
        if self.max_nonfinite < 1:
            raise GenolongError(f"max_nonfinite must be >= 1, got {self.max_nonfinite}")
        if self.balance_rate < 0 or self.aux_loss_coeff < 0:
            raise GenolongError(f"--balance-rate and --aux-loss-coeff must be >= 0 (0 = off), got {self.balance_rate} and {self.aux_loss_coeff}")
        if not 0 <= self.repeat_weight <= 1:
            raise GenolongError(f"--repeat-weight must be in [0, 1] (1 = repeats count fully, 0.1 = Evo 2), got {self.repeat_weight}")
        if self.planted_repeats is not None:
            from genolong.data.planted import PlantSpec

            PlantSpec.parse(self.planted_repeats).validate(window=self.seq_len + 1)
        if self.resume and self.overwrite:
            raise GenolongError("--resume and --overwrite exclude each other: --resume continues the run, --overwrite replaces it")
        if self.dist_timeout_s <= 0:
            raise GenolongError(f"--dist-timeout-s must be positive, got {self.dist_timeout_s}")
        from genolong.parallel.layout import parse_layout

        parse_layout(self.parallel)
        if self.preset is None and self.model_path is None:
            raise GenolongError("give --preset NAME (train from scratch) or --model CKPT (fine-tune a checkpoint)")
        self._validate_indexer()
        self.memory.validate()
        return self

    def _validate_indexer(self) -> None:
        coeff = self.indexer_loss_coeff
        if not (math.isfinite(coeff) and coeff >= 0):
            raise GenolongError(f"--indexer-loss-coeff must be a finite number >= 0 (0 keeps the indexer frozen), got {coeff}")
        if self.indexer_warmup_steps < 0 or self.indexer_recall_every < 0:
            raise GenolongError("--indexer-warmup-steps and --indexer-recall-every must be >= 0")
        if self.indexer_warmup_steps and coeff == 0:
            raise GenolongError(
                f"--indexer-warmup-steps {self.indexer_warmup_steps} trains the indexer, but --indexer-loss-coeff is 0 "
                "(frozen indexer); give --indexer-loss-coeff > 0 (e.g. 1.0)"
            )
        fraction = self.indexer_loss_queries
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise GenolongError(
                f"--indexer-loss-queries must be in (0, 1] (the share of query blocks the indexer's KL scores; 1: all), got {fraction}"
            )
        if fraction < 1 and coeff == 0:
            raise GenolongError(
                f"--indexer-loss-queries {fraction} subsamples the indexer's KL, but --indexer-loss-coeff is 0 "
                "(frozen indexer); give --indexer-loss-coeff > 0 (e.g. 1.0) or drop --indexer-loss-queries"
            )
        if self.indexer_recall_queries < 1:
            raise GenolongError(f"--indexer-recall-queries must be >= 1, got {self.indexer_recall_queries}")
        if self.indexer_topk is not None and self.indexer_topk < 1:
            raise GenolongError(f"--indexer-topk must be positive (keys each DSA query selects), got {self.indexer_topk}")
        if self.layers is not None and (self.layers < 1 or self.preset is None):
            raise GenolongError(
                f"--layers {self.layers}: the layer dial sizes a --preset model (>= 1 layer); a --model checkpoint keeps its own layers"
            )
        from genolong.data.kmers import MAX_K

        if self.copy_oracle and not 8 <= self.copy_oracle <= MAX_K:
            raise GenolongError(
                f"--copy-oracle {self.copy_oracle}: the k-mer length must be in 8..{MAX_K} (shorter k-mers match by chance "
                "everywhere), or 0 to turn the oracle off"
            )
        if self.copy_oracle:
            from genolong.parallel.layout import parse_layout

            layout = parse_layout(self.parallel)
            if layout is not None and layout.cp > 1:
                raise GenolongError("--copy-oracle runs on whole sequences: drop it or use a layout without cp")


def _known(cls, d: dict[str, Any]) -> dict[str, Any]:
    """Drop keys this version does not know (an options.json from a newer run still resumes)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}
