"""Checkpoints of a multi-process run: torch.distributed.checkpoint (DCP), atomic, loadable at any layout.

Layout of one checkpoint (beside the single-process format of genolong.train.checkpoint, in the
same `RUN_DIR/checkpoints/step_N/`; docs/parallel.md):

    config.json             the model's transformers config (what `genolong export` and a resume build)
    dcp/                    DCP files: "model.<key>" (the plain model's state-dict keys) and
                            "optimizer.<master|exp_avg|exp_avg_sq>.<parameter>" (fp32), each element
                            written once by the rank that holds it, with its global shape
    trainer_state.json      step, schedule, sampler position (layout-free, genolong.parallel.data),
                            optimizer step counts, the layout it was saved at, non-finite counters
    rng/rank_00000.json     each rank's RNG states
    tokenizer.json          when fine-tuning a GLM checkpoint (copied for the export)
    COMPLETE                the manifest, written last (genolong.checkpoint_dir.finalize)

Atomicity: every rank writes into `checkpoints/.tmp-step_N-<pid of rank 0>`; after a barrier
(every rank's files are on disk) rank 0 writes the manifest and renames the directory to
`step_N`; a rank that dies mid-save makes the collectives fail on the others, so no manifest is
written and no `step_N` appears (the temporary directory is removed by rank 0 or, if rank 0 died,
ignored and cleaned up by the next run).

Loading: the views of genolong.parallel.tensor_state give every tensor its global shape, so DCP
reads the parts this rank holds whatever layout wrote them (cp=2 -> one process, dp=2 -> dp=1,
tp=2 -> tp=1 ...). Without a process group (one process resuming or exporting) DCP reads on its own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.lifeline import uninterruptible

DCP_DIR = "dcp"
RNG_DIR = "rng"
CONFIG_FILE = "config.json"
FORMAT = "dcp"


def is_distributed(ckpt: Path) -> bool:
    """True for a checkpoint written by this module (False: the single-process format)."""
    return (Path(ckpt) / DCP_DIR).is_dir()


def _views(state: dict, pmesh) -> dict:
    if pmesh is None:
        return state
    from genolong.parallel.tensor_state import sharded_state_dict

    return sharded_state_dict(state, pmesh)


def _restore(state: dict, views: dict, pmesh) -> None:
    if pmesh is not None:
        from genolong.parallel.tensor_state import restore_from_sharded

        restore_from_sharded(state, views, pmesh)


def optimizer_tensors(optimizer) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(the optimizer's fp32 tensors, its step counts): tensors go to DCP, counts to trainer_state.json."""
    state = optimizer.state_dict()
    counts = {k: int(v) for k, v in state.items() if k == "step" or k.startswith("step.")}
    return {k: v for k, v in state.items() if k not in counts}, counts


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(run_dir: str | Path, step: int, *, model, optimizer, trainer_state: dict[str, Any], pmesh,
         keep_last: int, extra_files: dict[str, Path] | None = None) -> Path:
    """Write checkpoint `step` (module docstring). Collective: every rank calls it; returns the final path.
    Ctrl-C / SIGTERM wait for the end of the save (genolong.lifeline.uninterruptible)."""
    root = Path(run_dir) / checkpoint_dir.CHECKPOINTS
    rank = _rank()
    name = [f".tmp-{checkpoint_dir.step_dir_name(step)}-{os.getpid()}"] if rank == 0 else [None]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    tmp, final = root / name[0], root / checkpoint_dir.step_dir_name(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        # Rank 0 holds the run's lock: every temporary directory it finds is a dead save's.
        checkpoint_dir.remove_stale_temporaries(run_dir)
        tmp.mkdir()
    _barrier()
    with uninterruptible(f"checkpoint {final.name}"):
        _write(tmp, final, step, rank, run_dir, model, optimizer, trainer_state, pmesh, keep_last, extra_files)
    return final


def _write(tmp, final, step, rank, run_dir, model, optimizer, trainer_state, pmesh, keep_last, extra_files) -> None:
    from genolong.model.checkpoint import _dtype_name
    from genolong.model.hf_config import to_hf

    try:
        tensors, counts = optimizer_tensors(optimizer)
        dcp.save({"model": _views(model.state_dict(), pmesh), "optimizer": _views(tensors, pmesh)}, checkpoint_id=str(tmp / DCP_DIR))
        (tmp / RNG_DIR).mkdir(exist_ok=True)
        rng_file = tmp / RNG_DIR / f"rank_{rank:05d}.json"
        rng_file.write_text(json.dumps(checkpoint_dir.capture_rng()) + "\n", encoding="utf-8")
        checkpoint_dir.fsync_file(rng_file)
        _barrier()
        if rank == 0:
            config = to_hf(model.config, dtype=_dtype_name(model), source=getattr(model, "hf_source_config", None))
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            state = {**trainer_state, "format": FORMAT, "optimizer_steps": counts}
            (tmp / checkpoint_dir.STATE_FILE).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
            for rel, source in (extra_files or {}).items():
                shutil.copy2(source, tmp / rel)
            checkpoint_dir.finalize(tmp, final, step)
            checkpoint_dir.prune(run_dir, keep_last)
        _barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_model(ckpt: Path, dtype: torch.dtype, device: str):
    """The model of a DCP checkpoint with uninitialised weights (the load fills every one)."""
    from genolong.model import GenoLongForCausalLM
    from genolong.model.checkpoint import read_config
    from genolong.model.hf_config import from_hf

    raw = read_config(ckpt)
    with torch.device(device):
        model = GenoLongForCausalLM(from_hf(raw, name=ckpt.name), dtype=dtype, init=False)
    model.hf_source_config = raw
    return model


def load(ckpt: Path, *, model, optimizer=None, pmesh=None) -> dict[str, Any]:
    """Fill `model` (and `optimizer`) from checkpoint `ckpt`, saved at any layout; returns its trainer state.
    Collective when a process group exists."""
    state = checkpoint_dir.load_trainer_state(ckpt)
    model_state = model.state_dict()
    request = {"model": _views(model_state, pmesh)}
    if optimizer is not None:
        tensors, _ = optimizer_tensors(optimizer)
        request["optimizer"] = _views(tensors, pmesh)
    try:
        dcp.load(request, checkpoint_id=str(ckpt / DCP_DIR))
    except Exception as err:  # noqa: BLE001  (DCP wraps a missing key or a shape mismatch in several exception types)
        raise GenolongError(f"{ckpt} does not match the model and optimizer of this run ({_first_line(err)}); resume it with the same model and indexer options") from None
    _restore(model_state, request["model"], pmesh)
    if optimizer is not None:
        _restore(tensors, request["optimizer"], pmesh)
        counts = {k: torch.tensor(v, dtype=torch.int64) for k, v in state.get("optimizer_steps", {}).items()}
        optimizer.load_state_dict({**tensors, **counts})
    return state


def restore_rng(ckpt: Path) -> None:
    """This rank's RNG states as saved (rank 0's where the saving run had fewer ranks)."""
    path = ckpt / RNG_DIR / f"rank_{_rank():05d}.json"
    if not path.is_file():
        path = ckpt / RNG_DIR / f"rank_{0:05d}.json"
    checkpoint_dir.restore_rng(json.loads(path.read_text(encoding="utf-8")))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
