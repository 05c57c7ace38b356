"""The checkpoint directory both checkpoint formats share: `RUN_DIR/checkpoints/step_N/`.

genolong.train.checkpoint writes a one-process run's checkpoints, genolong.parallel.checkpoint a
multi-process run's (torch.distributed.checkpoint); both make a step directory complete the same
way and keep the same trainer state and RNG states, from here:

- a checkpoint is written into `checkpoints/.tmp-step_N-<pid>`; `finalize` fsyncs its files,
  writes the `COMPLETE` manifest ({step, files: {path: bytes}}) last and renames the directory
  to `step_N` (one atomic rename); `is_complete` checks the manifest against the files, so
  `latest` skips a directory damaged later;
- `prune` removes the manifest first, so a half-deleted checkpoint never looks complete;
- `remove_stale_temporaries` deletes what a killed save or prune left (the caller holds the run
  lock, genolong.train.checkpoint.locked);
- `trainer_state.json` (`load_trainer_state`) and the generators' states as JSON (`capture_rng`,
  `restore_rng`; no pickle in checkpoints).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Only genolong's own temporary names: a save in progress and a pruned checkpoint being deleted.
_STALE_DIR = re.compile(r"^\.(tmp|trash)-step_\d{8}-\d+$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(ckpt: Path) -> int:
    return int(_STEP_DIR.match(ckpt.name).group(1))


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


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete the temporary directories of saves (or prunes) that crashed; returns what was removed.

    Safe because the caller holds the run lock: no other process is writing into this run."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and _STALE_DIR.match(p.name)]
    for path in stale:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        notice(f"removed {path} ({size / 1e9:.2f} GB), left by a checkpoint save or prune that did not finish")
    return stale


def notice(message: str) -> None:
    print(f"genolong: {message}", file=sys.stderr, flush=True)


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
