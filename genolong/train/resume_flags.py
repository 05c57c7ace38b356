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

from pathlib import Path
from typing import Any

from genolong.errors import GenolongError
from genolong.train.flags import ALL, CHANGEABLE, changeable_flags
from genolong.train.flags import flag_text as _flag
from genolong.train.options import MemoryOptions, TrainOptions
from genolong.units import parse_length

__all__ = ["CHANGEABLE", "changeable_flags", "resume_options"]

# Read with the default when not given (they describe this invocation, not the run).
_ALWAYS_FROM_COMMAND_LINE = ("stop_after", "launcher", "parallel", "progress")
_NOT_OPTIONS = ("resume", "ctx", "overwrite")
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


def _get(options: TrainOptions, path: str) -> Any:
    obj: Any = options
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _target(name: str) -> tuple[str, str | None] | None:
    """(the option the flag sets, how its text is read: genolong.train.flags.Flag); None: no run option."""
    flag = ALL.get(name)
    if flag is None or flag.target is None:
        return None
    return flag.target, flag.kind


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
