"""The command-line flags of `finetune` and `plan`, declared once, in sections.

Each flag is one `Flag` (name, type, default, help, help panel) in one section: run, data,
optimizer, memory, parallel, indexer, balance. A command takes the flags it needs by name
(`command_signature`): typer reads the generated signature as if it were written out, so
`finetune` and `plan` share each common flag's spelling, default and help text, and
`train_options` turns finetune's parsed values into `TrainOptions` from the same declarations
(`Flag.target`: the option a flag sets; `Flag.kind`: how its text is read). `--resume` compares
the flags typed next to it with the run's options through the same targets
(genolong.train.resume_flags).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from genolong.train.options import MemoryOptions, TrainOptions
from genolong.units import parse_length

MEMORY_PANEL = "Memory optimizations (each one can be turned off; --baseline: all off)"
INDEXER_PANEL = "DSA indexer training (default: frozen)"
BALANCE_PANEL = "Expert balance and loss weighting"

# Flags a resumed run accepts (genolong.train.resume_flags): where and how this invocation runs,
# and how long the run is and how it is checkpointed.
PER_INVOCATION = ("stop_after", "device", "dtype", "kernels", "compile", "launcher", "ray_address", "parallel", "dist_timeout_s", "progress")
PER_RUN = ("steps", "save_every", "keep_last")
CHANGEABLE = PER_RUN + PER_INVOCATION


def flag_text(name: str, value: Any = None) -> str:
    """`--name`, `--name VALUE`, or for a switch `--name` / `--no-name` as `value` says."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{name.replace('_', '-')}"
    return flag if value is None else f"{flag} {value}"


def changeable_flags() -> str:
    """The flags --resume accepts, as `finetune --help`, its errors and the README list them."""
    return ", ".join(flag_text(n) for n in CHANGEABLE)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: the parameter `name` typer passes, its `type` and `default`, what
    `--help` says, and the option it sets (`target`, "memory.x" inside MemoryOptions; None: read
    by the command itself) read as `kind` ("length": a token count like 64k, "path", None: as is)."""

    name: str
    type: Any
    default: Any
    help: str | None = None
    decls: tuple[str, ...] = ()  # click's spellings when not --name (switches: "--x/--no-x")
    panel: str | None = None
    show_default: bool = True
    hidden: bool = False
    target: str | None = None
    kind: str | None = None

    def parameter(self) -> inspect.Parameter:
        option = typer.Option(*self.decls, help=self.help, rich_help_panel=self.panel, show_default=self.show_default, hidden=self.hidden)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default, annotation=Annotated[self.type, option])


def _switch(name: str, default: bool, help: str, **kw: Any) -> Flag:
    spelled = name.replace("_", "-")
    return Flag(name, bool, default, help, decls=(f"--{spelled}/--no-{spelled}",), **kw)


def flag_section(*flags: Flag) -> dict[str, Flag]:
    return {f.name: f for f in flags}


RUN = flag_section(
    Flag("preset", str, "glm53-mini", "Model preset to train from scratch: glm53-mini, glm-5.3-flash, tiny.", target="preset"),
    Flag("model", str | None, None, "A transformers glm5_next checkpoint directory to fine-tune (overrides --preset).", show_default=False,
         target="model_path", kind="path"),
    Flag("layers", int | None, None, "Layers of the --preset model (its one scale dial; default: the preset's).", show_default=False, target="layers"),
    Flag("out", str | None, None, "Run directory (log, checkpoints).", show_default=False, target="out", kind="path"),
    Flag("resume", str | None, None, "Continue the run in this directory from its latest complete checkpoint with its own options; only "
         f"{changeable_flags()} can change.", show_default=False),
    Flag("overwrite", bool, False, "Replace an earlier run in --out (e.g. one interrupted before its first checkpoint); never other data.",
         decls=("--overwrite",), target="overwrite"),
    Flag("steps", int, 80, "Optimizer steps.", target="steps"),
    Flag("seed", int, 0, "Seed of the model init, the window sampler and the RNGs.", target="seed"),
    Flag("save_every", int, 0, "Checkpoint every N steps (0: only at the end).", target="save_every"),
    Flag("keep_last", int, 2, "Complete checkpoints to keep.", target="keep_last"),
    Flag("stop_after", int | None, None, "End this invocation after N steps, checkpointed (continue with --resume).", show_default=False,
         target="stop_after"),
    Flag("kernels", str | None, None, "Hot-op policy: fused (fail loudly on a fallback), auto, reference (default: fused on CUDA, reference on CPU).",
         show_default=False, target="kernels"),
    Flag("device", str | None, None, "cuda, cuda:1, cpu (default: cuda if available).", show_default=False, target="device"),
    Flag("dtype", str | None, None, "bfloat16 or float32 parameters (default: bfloat16 on CUDA, float32 on CPU).", show_default=False, target="dtype"),
    Flag("progress", bool, True, "Show a progress bar.", decls=("--progress/--no-progress",), target="progress"),
    Flag("compile", bool | None, None, "torch.compile the small ops: norms, router, SwiGLU (and mHC, except on the GPU, where its "
         "fused kernels run). Default: on with the fused kernels on CUDA, off elsewhere.", decls=("--compile/--no-compile",), show_default=False,
         target="compile"),
)

DATA = flag_section(
    Flag("data", str | None, None, "A directory written by `genolong prepare`.", show_default=False, target="data", kind="path"),
    Flag("seq", str, "512k", "Tokens per sequence: 512k, 1M, 32k, 4096 (k = 1024).", target="seq_len", kind="length"),
    Flag("overfit", int, 0, "Train repeatedly on a fixed set of N windows (a correctness check).", target="overfit"),
    Flag("max_n_fraction", float, 0.1, "Skip windows with a larger fraction of N bases.", target="max_n_fraction"),
    Flag("planted_repeats", str | None, None, "Train on windows with planted repeats (copies of L bases placed d bases later), e.g. "
         "len=64,max-dist=48k,per-window=8 (docs/recall.md). Off by default.", show_default=False, target="planted_repeats"),
)

OPTIMIZER = flag_section(
    Flag("lr", float, 1e-4, "Peak learning rate (AdamW).", target="lr"),
    Flag("warmup", int, 10, "Linear warmup steps before the cosine decay.", target="warmup"),
    Flag("min_lr_ratio", float, 0.1, "Cosine floor as a fraction of --lr.", target="min_lr_ratio"),
    Flag("weight_decay", float, 0.1, "AdamW weight decay (matrices only).", target="weight_decay"),
    Flag("grad_clip", float, 1.0, "Max global gradient norm (0: no clipping).", target="grad_clip"),
    Flag("batch", int, 1, "Sequences per optimizer step.", target="batch"),
    Flag("grad_accum", int, 1, "Micro-batches the step's sequences are split into.", target="grad_accum"),
)

MEMORY = flag_section(
    _switch("recompute", True, "Full-layer activation recompute (off also turns offload off).", panel=MEMORY_PANEL, target="memory.recompute"),
    _switch("offload", True, "Layer inputs to pinned host memory.", panel=MEMORY_PANEL, target="memory.offload"),
    Flag("offload_layers", int | None, None, "Layers that offload (default: as many as the GPU budget needs).", panel=MEMORY_PANEL,
         show_default=False, target="memory.offload_layers"),
    Flag("keep_sparse", str, "auto", "Under recompute, keep the DSA selections and sparse-attention results from the forward instead of "
         "recomputing them: host (pinned memory), device, off; auto = host with --offload, else device.", panel=MEMORY_PANEL,
         target="memory.keep_sparse"),
    _switch("pinned", True, "Pinned (page-locked) host buffers.", panel=MEMORY_PANEL, target="memory.offload_pinned"),
    _switch("overlap", True, "Offload copies on their own streams.", panel=MEMORY_PANEL, target="memory.offload_overlap"),
    _switch("moe_chunking", True, "MoE in sequence chunks.", panel=MEMORY_PANEL, target="memory.moe_chunking"),
    Flag("moe_chunk", str, "64k", "Tokens per MoE chunk.", panel=MEMORY_PANEL, target="memory.moe_chunk_tokens", kind="length"),
    Flag("tile", str, "auto", "Each layer runs the sequence in checkpointed tiles of this many tokens (KDA state carried, DSA "
         "queries against the whole keys; the MoE per tile, unchunked). auto: on CUDA, the longest tile that "
         "makes the plan fit when whole layers do not; off: whole layers.", panel=MEMORY_PANEL),
    Flag("layer_inputs", str, "bf16", "How recompute stores each layer's input until backward (on the GPU or offloaded): bf16 (as it "
         "is, exact) or fp8 (e4m3 with one fp32 scale per row of hidden: about half the bytes; lossy: backward recomputes "
         "from the rebuilt input).", panel=MEMORY_PANEL, target="memory.layer_inputs"),
    _switch("keep_moe", False, "Under recompute, keep each chunked MoE's output from the forward: two MoE "
            "forwards a step instead of three, for hidden x 2 bytes a token and MoE layer "
            "where --keep-sparse keeps (opt-in: -0.14 s of a 6.5 s 128k step on an H100; +5 GiB pinned at 128k, +21 at 512k).",
            panel=MEMORY_PANEL, target="memory.keep_moe"),
    _switch("mhc_low_precision", True, "mHC projection without an fp32 input copy.", panel=MEMORY_PANEL, target="memory.mhc_low_precision"),
    _switch("chunked_loss", True, "LM head + loss in chunks (no [T, vocab] logits).", panel=MEMORY_PANEL, target="memory.chunked_loss"),
    Flag("loss_chunk", str | None, None, "Tokens per loss chunk (default: ~1 GiB of fp32 logits).", panel=MEMORY_PANEL, show_default=False,
         target="memory.loss_chunk_tokens", kind="length"),
    Flag("gpu_budget_gib", float | None, None, "GPU memory the step may use, GiB (default: 92% of the device's).", panel=MEMORY_PANEL,
         show_default=False, target="memory.gpu_budget_gib"),
    Flag("host_budget_gib", float | None, None, "Host memory for offloaded layer inputs per GPU, GiB; on the CPU, for the whole run (default: "
         "80% of the machine's RAM, shared by its GPUs).", panel=MEMORY_PANEL, show_default=False, target="memory.host_budget_gib"),
    Flag("baseline", bool, False, "Every memory optimization off (the stack out of the box).", decls=("--baseline",), panel=MEMORY_PANEL),
)
# The budgets' spellings before 0.2, hidden: the same quantities under their new names (finetune only;
# plan's old --gpu-gib / --host-gib meant the machine's memory and are its own).
OLD_BUDGETS = flag_section(
    Flag("gpu_budget", float | None, None, hidden=True, target="memory.gpu_budget_gib"),
    Flag("host_budget", float | None, None, hidden=True, target="memory.host_budget_gib"),
)

PARALLEL = flag_section(
    Flag("launcher", str, "local", "local (a spawned worker process) or ray (one Ray actor per rank). Under torchrun every rank runs in its own "
         "process.", target="launcher"),
    Flag("ray_address", str | None, None, "Ray cluster address (default: start a local Ray).", show_default=False, target="ray_address"),
    Flag("parallel", str | None, None, "Parallel layout, e.g. cp=2, dp=2,tp=4 or fsdp=2,cp=2,ep=2 (dp, fsdp, cp, tp, ep; fsdp: FSDP2 over fsdp x "
         "cp; default: one process, or dp = the processes torchrun started). docs/parallel.md.", show_default=False, target="parallel"),
    Flag("dist_timeout_s", float, 1800.0, "Seconds a collective waits for a missing rank before the run fails.", target="dist_timeout_s"),
)

BALANCE = flag_section(
    Flag("balance_rate", float, 1e-3, "Expert-balance bias step per optimizer step (DeepSeek-V3's auxiliary-loss-free balancing; 0: off; 1e-2 "
         "undoes a from-scratch run's early collapse faster, docs/training.md).", panel=BALANCE_PANEL, target="balance_rate"),
    Flag("aux_loss_coeff", float, 0.0, "Sequence-wise expert balance loss coefficient (DeepSeek-V3; 0: off, e.g. 1e-4).", panel=BALANCE_PANEL,
         target="aux_loss_coeff"),
    Flag("repeat_weight", float, 1.0, "Loss weight of soft-masked repeat bases (1: as others; Evo 2 uses 0.1).", panel=BALANCE_PANEL,
         target="repeat_weight"),
)

INDEXER = flag_section(
    Flag("indexer_loss_coeff", float, 0.0, "Train the DSA indexer with its KL loss at this weight (0: frozen indexer).", panel=INDEXER_PANEL,
         target="indexer_loss_coeff"),
    Flag("indexer_warmup_steps", int, 0, "First N steps train only the indexer, against dense attention (O(T^2): short contexts).",
         panel=INDEXER_PANEL, target="indexer_warmup_steps"),
    Flag("indexer_loss_queries", float, 1.0, "Share of query blocks (2048 queries) the sparse KL scores, drawn per step and layer "
         "(1: every query; e.g. 0.25 for a quarter of the loss's cost).", panel=INDEXER_PANEL, target="indexer_loss_queries"),
    Flag("indexer_recall_every", int, 0, "Every N steps log how much dense attention the indexer's selection keeps (0: never).",
         panel=INDEXER_PANEL, target="indexer_recall_every"),
    Flag("indexer_recall_queries", int, 256, "Sampled queries per DSA layer for the recall.", panel=INDEXER_PANEL, target="indexer_recall_queries"),
    Flag("indexer_topk", int | None, None, "Keys each DSA query selects in this run (default: the model's; the saved model keeps the new value).",
         panel=INDEXER_PANEL, show_default=False, target="indexer_topk"),
    Flag("copy_oracle", int, 0, "Copy curriculum: put into each query's selection the pool after the last earlier occurrence of its K last "
         "bases (K = 12-20; 0: off; docs/longrange.md).", panel=INDEXER_PANEL, target="copy_oracle"),
)

SECTIONS = {"run": RUN, "data": DATA, "optimizer": OPTIMIZER, "memory": MEMORY, "parallel": PARALLEL, "indexer": INDEXER, "balance": BALANCE}
ALL = {name: f for section in (*SECTIONS.values(), OLD_BUDGETS) for name, f in section.items()}

# finetune's flags in the order its --help lists them.
FINETUNE = (
    "data", "seq", "preset", "model", "out", "resume", "overwrite", "steps", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip",
    "batch", "grad_accum", "seed", "save_every", "keep_last", "stop_after", "overfit", "max_n_fraction", "planted_repeats", "kernels",
    "device", "dtype", "launcher", "ray_address", "parallel", "dist_timeout_s", "progress", "compile", *MEMORY, *OLD_BUDGETS, *BALANCE,
    *INDEXER, "layers",
)


def command_signature(names: Iterable[str], own: Mapping[str, Flag] | None = None) -> inspect.Signature:
    """The signature typer reads for a command `def cmd(ctx, **params)` taking the flags `names`,
    looked up in the command's `own` flags first, then in the shared sections."""
    flags = {**ALL, **(own or {})}
    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    return inspect.Signature([ctx, *(flags[name].parameter() for name in names)], return_annotation=None)


def with_flags(names: Iterable[str], own: Mapping[str, Flag] | None = None) -> Callable:
    """Decorator: give a `cmd(ctx, **params)` the generated signature of `names` (command_signature)."""

    def apply(command: Callable) -> Callable:
        command.__signature__ = command_signature(names, own)
        return command

    return apply


def memory_options(params: Mapping[str, Any], **overrides: Any) -> MemoryOptions:
    """MemoryOptions from a command's parsed parameters (typer's ctx.params; the memory flags `finetune`
    and `plan` share, MEMORY), `overrides` replacing some."""
    flags = {name: params[name] for name in MEMORY} | overrides
    return MemoryOptions.from_flags(flags.pop("baseline"), offload_pinned=flags.pop("pinned"), offload_overlap=flags.pop("overlap"), **flags)


def train_options(params: Mapping[str, Any], memory: MemoryOptions) -> TrainOptions:
    """TrainOptions from finetune's parsed flags (`params`, typer's ctx.params), `memory` the
    MemoryOptions already built from its memory flags (memory_options)."""

    values: dict[str, Any] = {"memory": memory}
    for name in FINETUNE:
        flag = ALL[name]
        if flag.target is None or flag.target.startswith("memory."):
            continue
        value = params[name]
        if flag.kind == "length":
            value = parse_length(value, flag_text(name))
        elif name in ("data", "model") and value is not None:
            # Absolute: a resume (--data), or eval-positional reading the run's baseline (--model), works from any directory.
            value = str(Path(value).resolve())
        values[flag.target] = value
    if params["model"]:
        values["preset"] = None  # --model overrides --preset
    return TrainOptions(**values)
