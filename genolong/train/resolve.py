"""A run resolved once: what its options mean on this machine, as one frozen `RunSpec`.

`TrainOptions` is what the user asked for; `resolve(options)` checks it (every check that needs no
model weights and no device: run directory, data, model source, parallel layout) and computes, in
one place, what the loop then only reads:

- the device (`--device`, or cuda when a GPU is visible) and the parameters' dtype;
- the hot-op kernel policy (fused on CUDA, reference on the CPU, unless `--kernels`);
- the requested parallel layout (`--parallel`, or dp = the processes torchrun started);
- the model config (the resumed checkpoint's, `--model`'s or the preset's, with `--indexer-topk`),
  read without weights, once;
- the latest complete checkpoint of a resumed run.

Two parts can only be settled later, inside the training process, and are added by copying the
spec: the rank's own device once the process group has placed it (`on_device`), and the memory
plan, which asks the GPU for its size (`planned`; the launcher's process never touches CUDA).

The launcher resolves a run before it starts a worker, so that bad input is one line at once; a
worker in another process resolves it again (cheaply); a torchrun rank resolves it once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from genolong.errors import GenolongError
from genolong.train import checkpoint as ckpt_io
from genolong.train.options import TrainOptions
from genolong.units import format_length


@dataclass(frozen=True)
class RunSpec:
    """One run's resolved settings (module docstring); `options` as given, validated."""

    options: TrainOptions
    device: str
    dtype: object  # torch.dtype (torch is imported lazily: the CLI's process stays light)
    kernels: str
    layout: object  # genolong.parallel.layout.ParallelLayout, as requested
    config: object  # genolong.model.config.ModelConfig of the model the run builds
    resume_from: Path | None = None
    plan: object | None = None  # genolong.train.plan.MemoryEstimate once `planned`; None for split layouts

    def on_device(self, device: str) -> RunSpec:
        """The spec for the device the process group placed this rank on (cuda -> cuda:N)."""
        return dataclasses.replace(self, device=device)

    def planned(self) -> RunSpec:
        """The spec with its memory plan; GenolongError (numbers, the short resource, what would fit)
        when one step cannot fit. With `--tile auto` the plan may choose a tile length, which it
        writes into `options.memory` (the memory pass applies it and options.json records it)."""
        from genolong.train.preflight import preflight, preflight_cpu

        options = self.options
        a = self.dtype.itemsize
        if not self.device.startswith("cuda"):
            est = preflight_cpu(self.config, options.seq_len, options.memory, batch=options.micro_batch, dtype_bytes=a)
        else:
            est = preflight(self.config, options.seq_len, options.memory, n_gpus=1, batch=options.micro_batch, dtype_bytes=a)
        return dataclasses.replace(self, plan=est)


def resolve(options: TrainOptions) -> RunSpec:
    """Check `options` and resolve them (module docstring); one-line GenolongError on bad input."""
    from genolong.train import distributed

    options.validate()
    if not options.out:
        raise GenolongError("--out is required: the run directory for the log and checkpoints")
    if not options.data:
        raise GenolongError("--data is required: a directory written by `genolong prepare`")
    resume_from = None
    if options.resume:
        resume_from = ckpt_io.check_run_dir(options.out)
    elif options.overwrite:
        ckpt_io.check_replaceable(options.out)
    else:
        ckpt_io.refuse_occupied(options.out)
    open_sampler(options)
    config = model_config(options, resume_from)
    if options.model_path and not options.resume:
        from genolong.model.vocab import dna_to_checkpoint_ids

        dna_to_checkpoint_ids(options.model_path, vocab_size=config.vocab_size)
    device = resolve_device(options)
    dtype = resolve_dtype(options, device)
    distributed.check_processes(options, config)
    return RunSpec(
        options=options,
        device=device,
        dtype=dtype,
        kernels=resolve_kernels(options, device),
        layout=distributed.requested_layout(options),
        config=config,
        resume_from=resume_from,
    )


def model_config(options: TrainOptions, resume_from: Path | None = None):
    """The config of the model the run will build (the loop's order: resumed checkpoint, --model,
    --preset), read without weights."""
    from genolong.model import get_preset
    from genolong.model.checkpoint import read_config
    from genolong.model.hf_config import from_hf
    from genolong.model.presets import with_indexer_topk
    from genolong.parallel import checkpoint as dist_ckpt

    if resume_from is not None and dist_ckpt.is_distributed(resume_from):
        return from_hf(read_config(resume_from))
    if resume_from is not None or options.model_path:
        source = resume_from / ckpt_io.MODEL_DIR if resume_from is not None else Path(options.model_path)
        return with_indexer_topk(from_hf(read_config(source)), options.indexer_topk)
    config = get_preset(options.preset) if options.layers is None else get_preset(options.preset, num_layers=options.layers)
    return with_indexer_topk(config, options.indexer_topk)


def open_sampler(options: TrainOptions, rank: int = 0, ranks: int = 1):
    """The window sampler of batch rank `rank` of `ranks` (genolong.parallel.data: every rank draws
    from the run's one stream of windows, each step's `batch` windows split over the ranks)."""
    from genolong.data import WindowSampler, open_prepared

    if not Path(options.data).is_dir():
        raise GenolongError(f"--data {options.data}: no such directory; run `genolong prepare` first and pass its --out")
    genome = open_prepared(options.data)
    # seq_len + 1 bases: the model reads seq_len tokens and predicts each one's successor.
    records = genome.records(options.split)
    longest = max((n for _, n in records), default=0)
    if options.seq_len + 1 > longest:
        raise GenolongError(
            f"--seq {format_length(options.seq_len)} needs windows of {options.seq_len + 1:,} bases (the inputs plus "
            f"one shifted target) but the longest {options.split!r} record of {options.data} has {longest:,}; "
            f"use --seq {longest - 1} or less, or prepare longer records into that split"
        )
    sampler = WindowSampler(
        genome,
        options.split,
        options.seq_len + 1,
        seed=options.seed,
        max_n_fraction=options.max_n_fraction,
        reverse_complement=options.reverse_complement,
        rank=rank,
        world_size=ranks,
    )
    if options.planted_repeats:
        from genolong.data.planted import PlantedRepeatSampler, PlantSpec

        sampler = PlantedRepeatSampler(sampler, PlantSpec.parse(options.planted_repeats), seed=options.seed)
    return sampler


def resolve_device(options: TrainOptions) -> str:
    import torch

    if options.device:
        if options.device.startswith("cuda") and not torch.cuda.is_available():
            raise GenolongError(f"--device {options.device} but no CUDA GPU is visible; use --device cpu")
        return options.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_kernels(options: TrainOptions, device: str) -> str:
    """The ops policy (genolong.model.ops): unset means fused (fail loudly on fallback) on CUDA and
    reference on CPU; "auto" is the ops policy of that name (fused where it runs, both recorded)."""
    if options.kernels is not None:
        return options.kernels
    return "fused" if device.startswith("cuda") else "reference"


def resolve_dtype(options: TrainOptions, device: str):
    import torch

    name = options.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise GenolongError(f"dtype must be bfloat16 or float32, got {name!r}")
    return table[name]
