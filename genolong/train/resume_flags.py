"""`genolong finetune --resume RUN` and the other flags given with it.

A resumed run is the run in RUN: its options.json decides what is trained. Flags given on the
command line next to --resume are sorted three ways (docs/training.md, "Resume"):

- where and how this invocation runs: `--device`, `--dtype`, `--kernels`, `--compile`,
  `--launcher`, `--ray-address`, `--parallel`, `--dist-timeout-s`, `--progress`, `--stop-after`
  apply to this invocation only (a run saved at one parallel layout resumes at another,
  docs/parallel.md; `--parallel` unset is one process, or dp = the processes torchrun started);
- how long the run is and how it is checkpointed: `--steps`, `--save-every`, `--keep-last` apply
  and are written back to options.json, so the next resume keeps them (a new `--steps`
  re-derives the cosine schedule for the new length: genolong.train.loop);
- anything else must equal the run's own value; a flag that differs is an error naming it
  (silently ignoring it would train something other than what was asked for).

"Given" means typed on the command line (or set through the environment), not a default: click
records where each parameter's value came from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from genolong.errors import GenolongError
from genolong.train.options import MemoryOptions, TrainOptions
from genolong.units import parse_length

PER_INVOCATION = ("stop_after", "device", "dtype", "kernels", "compile", "launcher", "ray_address", "parallel", "dist_timeout_s", "progress")
PER_RUN = ("steps", "save_every", "keep_last")
CHANGEABLE = PER_RUN + PER_INVOCATION
# Read with the default when not given (they describe this invocation, not the run).
_ALWAYS_FROM_COMMAND_LINE = ("stop_after", "launcher", "parallel", "progress")
_NOT_OPTIONS = ("resume", "ctx", "overwrite")

# Command-line parameter -> (TrainOptions attribute path, how to read the flag's value).
_RENAMED = {
    "seq": ("seq_len", "length"),
    "model": ("model_path", "path"),
    "data": ("data", "path"),
    "out": ("out", "path"),
    "moe_chunk": ("memory.moe_chunk_tokens", "length"),
    "loss_chunk": ("memory.loss_chunk_tokens", "length"),
    "pinned": ("memory.offload_pinned", None),
    "overlap": ("memory.offload_overlap", None),
    "gpu_budget": ("memory.gpu_budget_gib", None),
    "host_budget": ("memory.host_budget_gib", None),
}
_SWITCHES = ("recompute", "offload", "offload_pinned", "offload_overlap", "moe_chunking", "mhc_low_precision", "chunked_loss")


def resume_options(run_dir: str, values: dict[str, Any], given: set[str]) -> TrainOptions:
    """The run's options with the command line's changeable flags applied; GenolongError naming
    the first flag that would change anything else."""
    from genolong.train.loop import load_run_options

    if values.get("overwrite"):
        raise GenolongError("--resume and --overwrite exclude each other: --resume continues the run, --overwrite replaces it")
    options = load_run_options(run_dir)
    for name in sorted(given - set(CHANGEABLE) - set(_NOT_OPTIONS)):
        matches = _matches(name, values[name], options)
        if matches is None:
            raise GenolongError(
                f"{_flag(name, values[name])} cannot be combined with --resume {run_dir} (it is not one of the flags a resumed "
                f"run can change: {changeable_flags()}); drop it, or start a new run (a new --out, or --overwrite)"
            )
        if not matches:
            raise GenolongError(
                f"{_flag(name, values[name])} differs from the run's own setting ({_saved(name, options)}): --resume continues "
                f"{run_dir} with the options it was started with, and only {changeable_flags()} can change; drop "
                f"{_flag(name, values[name]) if isinstance(values[name], bool) else _flag(name)}, "
                "or start a new run with it (a new --out, or --overwrite)"
            )
    for name in CHANGEABLE:
        if name in values and (name in given or name in _ALWAYS_FROM_COMMAND_LINE):
            setattr(options, name, values[name])
    options.validate()
    return options


def changeable_flags() -> str:
    """The flags --resume accepts, as `finetune --help`, its errors and the README list them."""
    return ", ".join(_flag(n) for n in CHANGEABLE)



def _flag(name: str, value: Any = None) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{name.replace('_', '-')}"
    return flag if value is None else f"{flag} {value}"


def _get(options: TrainOptions, path: str) -> Any:
    obj: Any = options
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _target(name: str) -> tuple[str, str | None] | None:
    if name in _RENAMED:
        return _RENAMED[name]
    if name in {f.name for f in dataclasses.fields(TrainOptions)}:
        return name, None
    if name in _memory_fields():
        return f"memory.{name}", None
    return None


def _memory_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(MemoryOptions)}


def _matches(name: str, value: Any, options: TrainOptions) -> bool | None:
    """Whether the flag's value equals the run's; None when the flag maps to no run option."""
    if name == "baseline":
        base = MemoryOptions.baseline()
        return not value or all(getattr(options.memory, k) == getattr(base, k) for k in _SWITCHES)
    target = _target(name)
    if target is None:
        return None
    path, kind = target
    saved = _get(options, path)
    if value is None:
        return saved is None
    if kind == "length":
        return saved == parse_length(value, _flag(name))
    if kind == "path":
        return saved is not None and Path(str(value)).resolve() == Path(str(saved)).resolve()
    return saved == value


def _saved(name: str, options: TrainOptions) -> str:
    if name == "baseline":
        return "memory switches " + ", ".join(f"{k}={getattr(options.memory, k)}" for k in _SWITCHES)
    target = _target(name)
    if target is None:
        return "not a run option"
    saved = _get(options, target[0])
    return "not set" if saved is None else repr(saved)
