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

Atomicity: a checkpoint is written into `checkpoints/.tmp-step_N-<pid>` (files fsynced), the
`COMPLETE` manifest is written last, and only then is the directory renamed to `step_N` (one
atomic rename). A crash at any point leaves either no `step_N` or a complete one; `latest()`
also checks the manifest against the files, so a directory damaged later is skipped too.
Pruning removes the manifest first, so a half-deleted checkpoint never looks complete.

That is the format of a one-process run. A multi-process run writes torch.distributed.checkpoint
files into the same `checkpoints/step_N/` (genolong.parallel.checkpoint: `dcp/`, `config.json`,
`rng/`, the same trainer_state.json and COMPLETE manifest, made complete by `finalize` here);
either format resumes at any layout, and `genolong export` turns either into a transformers
checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from genolong.errors import GenolongError

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
OPTIONS_FILE = "options.json"
METRICS_FILE = "metrics.jsonl"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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
    prune(run_dir, keep_last)
    return final


def finalize(tmp: Path, final: Path, step: int) -> None:
    """Make the fully written `tmp` the checkpoint `final`: fsync its files, write the COMPLETE
    manifest last, rename (one atomic step). Also the last step of a multi-process save."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    for rel in files:
        fsync_file(tmp / rel)
    manifest = {"step": step, "files": files}
    (tmp / COMPLETE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    fsync_file(tmp / COMPLETE)
    if final.exists():
        # Re-saving a step (a resumed run that stops where it was saved): drop the old copy first.
        _remove(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def is_complete(ckpt: Path) -> bool:
    """True iff the manifest exists and every file it lists is there with its recorded size."""
    try:
        manifest = json.loads((ckpt / COMPLETE).read_text(encoding="utf-8"))
        return all((ckpt / rel).is_file() and (ckpt / rel).stat().st_size == size for rel, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune(run_dir: str | Path, keep_last: int) -> None:
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        _remove(old)


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))


def load_optimizer_state(ckpt: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    return load_file(ckpt / OPTIMIZER_FILE, device=str(device))


def check_run_dir(run_dir: str | Path) -> Path:
    """The latest complete checkpoint of a run directory, or GenolongError saying what is wrong."""
    run = Path(run_dir)
    if not run.is_dir():
        raise GenolongError(f"--resume {run_dir}: no such directory; pass the --out directory of an earlier finetune run")
    if not (run / OPTIONS_FILE).is_file():
        raise GenolongError(f"--resume {run_dir}: not a genolong run (no {OPTIONS_FILE}); pass the --out directory of a finetune run")
    ckpt = latest(run)
    if ckpt is None:
        raise GenolongError(
            f"--resume {run_dir}: the run has no complete checkpoint yet (none saved before it stopped); "
            "start it again without --resume, or with --save-every N to checkpoint more often"
        )
    return ckpt


# ------------------------------------------------------------------------------- RNG states


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA generator states as JSON (no pickle in checkpoints)."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_unb64(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            torch.cuda.set_rng_state(saved[0])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


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


# ------------------------------------------------------------------------------- file system


def _remove(ckpt: Path) -> None:
    (ckpt / COMPLETE).unlink(missing_ok=True)
    trash = ckpt.with_name(f".trash-{ckpt.name}-{os.getpid()}")
    os.rename(ckpt, trash)
    shutil.rmtree(trash, ignore_errors=True)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fsync_file(path)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename is still atomic
