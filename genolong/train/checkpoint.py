"""Training checkpoints: atomic, complete, resumable; the last K kept.

Layout of a run directory (docs/training.md):

    RUN_DIR/options.json                    the TrainOptions of the run (resume rebuilds from it)
    RUN_DIR/metrics.jsonl                   one JSON line per step
    RUN_DIR/checkpoints/step_00000080/
        model/                              transformers glm5_next checkpoint (config.json,
                                            model.safetensors, tokenizer.json when fine-tuning
                                            a GLM checkpoint): loadable by `--model` and by eval
        optimizer.safetensors               fp32 master weights, AdamW moments, step count
        trainer_state.json                  step, schedule, sampler position, RNG states,
                                            non-finite counters, DNA -> token id map
        COMPLETE                            manifest, written last: {step, files: {path: bytes}}

Atomicity (genolong.checkpoint_dir, shared with the multi-process format): a checkpoint is written
into `checkpoints/.tmp-step_N-<pid>` (files fsynced), the `COMPLETE` manifest is written last, and
only then is the directory renamed to `step_N` (one atomic rename). A crash at any point leaves
either no `step_N` or a complete one; `latest()` also checks the manifest against the files, so a
directory damaged later is skipped too. Pruning removes the manifest first, so a half-deleted
checkpoint never looks complete.
A save holds Ctrl-C / SIGTERM back until it is done (genolong.lifeline.uninterruptible);
a save killed outright (SIGKILL, power loss) leaves only its `.tmp-step_N-<pid>` directory, which
the next save or resume of the run removes, with a line on stderr.

The run directory is locked (`RUN_DIR/.lock`, an advisory `flock` held by the training process
and released by the kernel however it exits), so two processes never train into one directory
and every temporary directory found by the lock's holder is stale.

Recovery (docs/training.md, "Interrupted runs"): a run with a complete checkpoint continues with
`--resume RUN_DIR`; a run without one is started again with `--overwrite`.

That is the format of a one-process run (the lock is rank 0's in a multi-process run). A multi-process run writes torch.distributed.checkpoint
files into the same `checkpoints/step_N/` (genolong.parallel.checkpoint: `dcp/`, `config.json`,
`rng/`, the same trainer_state.json and COMPLETE manifest, made complete by genolong.checkpoint_dir.finalize);
either format resumes at any layout, and `genolong export` turns either into a transformers
checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from genolong.checkpoint_dir import (
    CHECKPOINTS,
    STATE_FILE,
    finalize,
    latest,
    notice,
    prune,
    remove_stale_temporaries,
    step_dir_name,
    step_of,
)
from genolong.errors import GenolongError
from genolong.lifeline import uninterruptible

MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIONS_FILE = "options.json"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".lock"


def save(
    run_dir: str | Path,
    step: int,
    write_model,
    optimizer_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint `step` atomically (module docstring) and prune to the last `keep_last`.

    `write_model(path)` writes the model directory (it must create `path`).
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    with uninterruptible(f"checkpoint {step_dir_name(step)}"):
        return _save(root, step, write_model, optimizer_state, trainer_state, keep_last)


def _save(root: Path, step: int, write_model, optimizer_state, trainer_state, keep_last: int) -> Path:
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_model(tmp / MODEL_DIR)
        save_file({k: v.detach().contiguous().cpu() for k, v in optimizer_state.items()}, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=1) + "\n", encoding="utf-8")
        finalize(tmp, final, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root.parent, keep_last)
    return final


def load_optimizer_state(ckpt: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    return load_file(ckpt / OPTIMIZER_FILE, device=str(device))


def check_run_dir(run_dir: str | Path, flag: str = "--resume") -> Path:
    """The latest complete checkpoint of a run directory, or GenolongError saying what is wrong.

    `flag` is the option that named the directory: --resume (continue the run) or export's --run.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise GenolongError(f"{flag} {run_dir}: no such directory; pass the --out directory of an earlier finetune run")
    if not (run / OPTIONS_FILE).is_file():
        raise GenolongError(f"{flag} {run_dir}: not a genolong run (no {OPTIONS_FILE}); pass the --out directory of a finetune run")
    ckpt = latest(run)
    if ckpt is None and flag != "--resume":
        raise GenolongError(f"{flag} {run_dir}: the run has no complete checkpoint (it stopped before its first save), so there is nothing to read")
    if ckpt is None:
        raise GenolongError(
            f"--resume {run_dir}: the run has no complete checkpoint (it stopped before its first save), so there is nothing to continue; "
            f"start it again with its original command plus --overwrite (replaces {run_dir}); --save-every N checkpoints more often"
        )
    return ckpt


# ------------------------------------------------------------------------------- run directory


def _planned_steps(run: Path) -> int | None:
    try:
        return int(json.loads((run / OPTIONS_FILE).read_text(encoding="utf-8"))["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def describe_progress(run_dir: str | Path) -> str:
    """"last complete checkpoint: step 20 of 80" or "no complete checkpoint"."""
    run = Path(run_dir)
    ckpt = latest(run)
    if ckpt is None:
        return "no complete checkpoint"
    total = _planned_steps(run)
    return f"last complete checkpoint: step {step_of(ckpt)}" + (f" of {total}" if total else "")


def recovery_hint(run_dir: str | Path) -> str:
    """What to type next for a run that stopped early (one clause, for error and interrupt lines)."""
    if latest(run_dir) is None:
        return f"no complete checkpoint yet: start it again with the same command plus --overwrite (replaces {run_dir})"
    from genolong.invocation import command

    return f"{describe_progress(run_dir)}: continue with `{command()} finetune --resume {run_dir}`"


def refuse_occupied(out: str | Path) -> None:
    """--out without --resume/--overwrite: an existing run is never written over silently, and a
    file or another program's directory is never written into."""
    run = Path(out)
    if run.exists() and not run.is_dir():
        raise GenolongError(f"--out {out} is a file, not a directory; pick another --out")
    if not (run / OPTIONS_FILE).exists():
        if run.is_dir() and [p for p in run.iterdir() if p.name != LOCK_FILE]:
            raise GenolongError(
                f"--out {out} is a directory that holds other files and no genolong run; pick a new or empty --out"
            )
        return
    if latest(out) is None:
        raise GenolongError(
            f"--out {out} holds a run that stopped before its first complete checkpoint; start it again by adding "
            "--overwrite (replaces it), or pick a new --out"
        )
    raise GenolongError(
        f"--out {out} already holds a run ({describe_progress(out)}); continue it with --resume {out}, "
        "replace it with --overwrite, or pick a new --out"
    )


def check_replaceable(out: str | Path) -> None:
    """--overwrite deletes only an earlier genolong run (or an empty directory), never other data."""
    run = Path(out)
    if run.is_symlink() or (run.exists() and not run.is_dir()):
        raise GenolongError(f"--out {out} is not a directory; pick another --out")
    if not run.is_dir():
        return
    others = [p.name for p in run.iterdir() if p.name != LOCK_FILE]
    if others and not (run / OPTIONS_FILE).is_file():
        raise GenolongError(
            f"--overwrite: {out} is not a genolong run (no {OPTIONS_FILE}) and not empty, so it is not deleted; "
            "pick another --out or empty it yourself"
        )


def clear_for_overwrite(run_dir: str | Path) -> None:
    """Empty an earlier run's directory (kept, with its lock) for --overwrite; call with the lock held."""
    run = Path(run_dir)
    check_replaceable(run)
    entries = [p for p in run.iterdir() if p.name != LOCK_FILE]
    if not entries:
        return
    notice(f"--overwrite: removing the earlier run in {run_dir} ({describe_progress(run)})")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@contextlib.contextmanager
def locked(run_dir: str | Path):
    """Hold RUN_DIR/.lock for the block (creating RUN_DIR); GenolongError if another process holds it."""
    run = Path(run_dir)
    created = not run.exists()
    run.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the rest works the same
        yield
        return
    fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise GenolongError(
                f"{run_dir} is in use by another genolong training process (pid {holder}); wait for it or stop it, "
                "or pick another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    except BaseException as err:
        # A run refused before it wrote anything (bad input, the memory pre-flight) leaves no directory;
        # nor does one that this call created and an input error stopped before its first checkpoint
        # (a kernel missing under --kernels fused, no usable window): the corrected command just runs.
        # An interrupted run keeps its logs (its hint says --overwrite).
        refused = isinstance(err, GenolongError) and not getattr(err, "keeps_run", False) and latest(run) is None
        if created and (refused or [p.name for p in run.iterdir()] == [LOCK_FILE]):
            shutil.rmtree(run, ignore_errors=True)
        raise
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ------------------------------------------------------------------------------- JSON for sampler state


def to_jsonable(obj: Any) -> Any:
    """Sampler state and the like as JSON: numpy scalars/arrays and tensors become lists/numbers."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    return obj


def from_jsonable(obj: Any) -> Any:
    """Inverse of to_jsonable for what it wraps (ndarrays and tensors); tuples come back as lists."""
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return np.array(obj["__ndarray__"], dtype=obj["dtype"])
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj
