"""`genolong export`: one checkpoint of a run as a single transformers `glm5_next` checkpoint directory.

A multi-process run's checkpoints are torch.distributed.checkpoint files (genolong.parallel.checkpoint),
sharded however the run was laid out; `--model`, `eval-positional --checkpoint` and transformers
read a transformers directory. The export builds the model in one process (no process group: DCP
reads every part), loads the checkpoint's weights and writes them with
genolong.model.save_pretrained (atomically), with the run's tokenizer.json when it fine-tuned a GLM
checkpoint. A one-process checkpoint already holds that directory (`model/`); it is copied.

The whole model is built in host memory: fine for glm53-mini (1.15B parameters, 2.3 GB in bf16);
the 313B glm-5.3-flash needs ~630 GB of RAM for it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.staging import settle_permissions, staging_dir, write_error
from genolong.parallel import checkpoint as dist_ckpt
from genolong.train import checkpoint as ckpt_io


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The complete checkpoint `step` of a run (None: the latest), or a one-line GenolongError."""
    latest = ckpt_io.check_run_dir(run_dir, flag="--run")
    if step is None:
        return latest
    found = {int(p.name.removeprefix("step_")): p for p in checkpoint_dir.complete_checkpoints(run_dir)}
    if step not in found:
        raise GenolongError(f"--step {step}: {run_dir} has no complete checkpoint of that step; it has step(s) {', '.join(map(str, sorted(found)))}")
    return found[step]


def saved_dtype(ckpt: Path) -> torch.dtype:
    """The dtype of a DCP checkpoint's model weights (that of lm_head; the rest follows the model's policy)."""
    meta = dcp.FileSystemReader(str(ckpt / dist_ckpt.DCP_DIR)).read_metadata()
    return meta.state_dict_metadata["model.lm_head.weight"].properties.dtype


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write checkpoint `step` (None: the latest) of the run in `run_dir` to `out`; returns `out`."""
    from genolong.model import save_pretrained

    ckpt = find_checkpoint(run_dir, step)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GenolongError(f"--out {out} is a file; pass a new directory for the exported checkpoint")
    if out.exists() and any(out.iterdir()):
        raise GenolongError(f"--out {out} exists and is not empty; pick a new directory (nothing is overwritten)")
    if out.resolve().is_relative_to(ckpt.resolve()):
        raise GenolongError(f"--out {out} is inside the checkpoint it exports ({ckpt}); pass a directory outside the run's checkpoints")
    if not dist_ckpt.is_distributed(ckpt):
        _copy_tree(ckpt / ckpt_io.MODEL_DIR, out)
        return out
    model = dist_ckpt.build_model(ckpt, saved_dtype(ckpt), "cpu")
    dist_ckpt.load(ckpt, model=model)
    save_pretrained(model, out)
    tokenizer = ckpt / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copy2(tokenizer, out / "tokenizer.json")
    return out


def _copy_tree(source: Path, out: Path) -> None:
    tmp = staging_dir(out)
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        settle_permissions(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except OSError as err:
        unreadable = _unreadable_source(source, err)
        if unreadable is not None:
            raise GenolongError(
                f"--run: could not read {unreadable} of the checkpoint being exported; check its permissions "
                "(or that the run's disk is mounted), or export another --step"
            ) from None
        raise write_error(out, err) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unreadable_source(source: Path, err: OSError) -> str | None:
    """The checkpoint file behind a failed copy when the failure was reading it (None: writing).

    copytree reports a file's failure as shutil.Error, a list of (source, destination, reason) for
    every file that failed; any other OSError names the path it was about. A source path that this
    process cannot read is a read failure, whatever the reason's text says.
    """
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
        paths = [entry[0] for entry in err.args[0] if isinstance(entry, tuple) and entry]
    else:
        paths = [err.filename] if err.filename is not None else []
    for path in map(Path, paths):
        if path.resolve().is_relative_to(source.resolve()) and not os.access(path, os.R_OK):
            return repr(str(path))
    return None

