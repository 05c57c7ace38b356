"""What `--checkpoint` and `--baseline` name, and loading it for scoring.

Accepted forms:
- `RUN` — a finetune run directory (has options.json): its latest complete checkpoint;
- `RUN@STEP` — that run's checkpoint of step STEP (`RUN@0` is the starting model when the run
  saved step 0), or `RUN@latest`;
- a checkpoint directory of a run (`RUN/checkpoints/step_00000080`);
- a model directory (config.json + safetensors): a transformers glm5_next checkpoint, or the
  `model/` folder inside a run checkpoint.

The architecture is read from config.json without loading weights, so mismatched models are
refused before anything heavy happens. A model is identified by a fingerprint of its content
(genolong.eval.fingerprint), never by path or modification time. The DNA -> token id map comes from the run's trainer
state when there is one (what training fed the model), else from the model itself: identity for
DNA-vocabulary models, the checkpoint's tokenizer.json for GLM-vocabulary ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import torch

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.eval.fingerprint import model_fingerprint
from genolong.eval.run import ModelSpec
from genolong.vocab import DNA_BASES, DNA_MODEL_VOCAB_SIZE
from genolong.invocation import command

_AT_STEP = re.compile(r"^(?P<run>.+)@(?P<step>\d+|latest)$")


@dataclasses.dataclass
class Resolved:
    spec: ModelSpec
    model_dir: Path


def _train_ckpt():
    from genolong.train import checkpoint

    return checkpoint


def _is_run(path: Path) -> bool:
    ck = _train_ckpt()
    return path.is_dir() and ((path / ck.OPTIONS_FILE).is_file() or (path / checkpoint_dir.CHECKPOINTS).is_dir())


def _is_run_checkpoint(path: Path) -> bool:
    ck = _train_ckpt()
    return path.is_dir() and (path / ck.MODEL_DIR).is_dir() and (path / checkpoint_dir.STATE_FILE).is_file()


def _steps(run: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in checkpoint_dir.complete_checkpoints(run)]


def resolve(text: str, flag: str) -> Resolved:
    """Turn a --checkpoint / --baseline argument into the model directory to load, or refuse it."""
    ck = _train_ckpt()
    step: str | None = None
    path = Path(text)
    m = _AT_STEP.match(text)
    if m and not path.exists():
        path, step = Path(m["run"]), m["step"]
    if not path.exists():
        raise GenolongError(
            f"{flag} {text}: no such file or directory; pass a finetune run directory (RUN, RUN@STEP) or a checkpoint directory"
        )
    if path.name == ck.MODEL_DIR and _is_run_checkpoint(path.parent):
        path = path.parent  # the model folder of a run checkpoint: use the checkpoint (its trainer state)
    state: dict | None = None
    ckpt_dir: Path | None = None
    if _is_run(path):
        if step in (None, "latest"):
            ckpt_dir = checkpoint_dir.latest(path)
            if ckpt_dir is None:
                raise GenolongError(f"{flag} {text}: the run has no complete checkpoint yet; wait for its first save or pass a checkpoint directory")
        else:
            ckpt_dir = path / checkpoint_dir.CHECKPOINTS / checkpoint_dir.step_dir_name(int(step))
            if not checkpoint_dir.is_complete(ckpt_dir):
                have = ", ".join(str(s) for s in _steps(path)) or "none"
                raise GenolongError(
                    f"{flag} {text}: the run has no complete checkpoint of step {int(step)} (steps saved: {have}); "
                    f"pick one of those, or pass the starting model's directory"
                )
        label = f"{path.name} step {int(checkpoint_dir.load_trainer_state(ckpt_dir).get('step', _step_of(ckpt_dir)))}"
    elif step is not None:
        raise GenolongError(f"{flag} {text}: {path} is not a finetune run directory (no {ck.OPTIONS_FILE}), so @{step} means nothing")
    elif _is_run_checkpoint(path):
        if not checkpoint_dir.is_complete(path):
            raise GenolongError(f"{flag} {text}: this checkpoint is incomplete (interrupted save); pass another step")
        ckpt_dir = path
        label = f"{path.parent.parent.name} step {_step_of(path)}"
    if ckpt_dir is not None and (ckpt_dir / "dcp").is_dir():
        run = ckpt_dir.parent.parent
        raise GenolongError(
            f"{flag} {text}: {ckpt_dir.name} was saved by a multi-process run (torch.distributed.checkpoint); export it first with "
            f"`{command()} export --run {run} --step {_step_of(ckpt_dir)} --out DIR` and pass DIR"
        )
    if ckpt_dir is not None:
        state = checkpoint_dir.load_trainer_state(ckpt_dir)
        model_dir = ckpt_dir / ck.MODEL_DIR
    else:
        model_dir = path
        label = path.name or text
    return Resolved(_spec(text, label, model_dir, state, flag), model_dir)


def _run_of(text: str) -> Path | None:
    """The run directory a --checkpoint argument belongs to, if it names one."""
    path = Path(text)
    m = _AT_STEP.match(text)
    if m and not path.exists():
        path = Path(m["run"])
    if _is_run(path):
        return path
    if _is_run_checkpoint(path) and _is_run(path.parent.parent):
        return path.parent.parent
    return None


def default_baseline(checkpoint: str) -> Resolved:
    """No --baseline: the run's step-0 checkpoint if it saved one, else the model the run started from."""
    ck = _train_ckpt()
    run = _run_of(checkpoint)
    if run is None:
        raise GenolongError(
            f"--baseline is needed: --checkpoint {checkpoint} is not a finetune run, so there is no starting model to "
            "default to; pass the model before fine-tuning with --baseline"
        )
    if checkpoint_dir.is_complete(run / checkpoint_dir.CHECKPOINTS / checkpoint_dir.step_dir_name(0)):
        return resolve(f"{run}@0", "--baseline")
    try:
        options = json.loads((run / ck.OPTIONS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        options = {}
    start = options.get("model_path")
    if start and not Path(start).is_absolute() and not Path(start).exists():
        # Runs of older versions kept the path as typed, relative to where finetune ran.
        raise GenolongError(
            f"--baseline is needed: run {run} started from the model {start!r} (its options.json model_path, relative to "
            "the directory finetune ran in), which is not found from here; pass that model with --baseline"
        )
    if start:
        return resolve(str(start), "--baseline")
    raise GenolongError(
        f"--baseline is needed: run {run} started from preset {options.get('preset')!r} (random weights) and saved no "
        "step-0 checkpoint; pass the starting model with --baseline (e.g. a run checkpoint from before fine-tuning)"
    )


def _step_of(ckpt_dir: Path) -> int:
    try:
        return int(ckpt_dir.name.split("_")[1])
    except (IndexError, ValueError):
        return -1


def _spec(source: str, label: str, model_dir: Path, state: dict | None, flag: str) -> ModelSpec:
    from genolong.model import checkpoint as model_ckpt
    from genolong.model import hf_config

    try:
        raw = model_ckpt.read_config(model_dir)
    except GenolongError as err:
        raise GenolongError(f"{flag} {source}: {err}") from None
    try:
        config = hf_config.from_hf(raw, name=model_dir.name)
    except GenolongError as err:
        raise GenolongError(f"{flag} {source}: {err}") from None
    arch = dataclasses.asdict(config)
    # Not architecture: a display name and the init scale of a from-scratch model.
    arch.pop("name", None)
    arch.pop("initializer_range", None)
    arch = json.loads(json.dumps(arch))  # tuples -> lists, so a JSON round trip compares equal
    token_map = _token_map(state, model_dir, config.vocab_size, flag, source)
    if not any(model_dir.glob("*.safetensors")):
        raise GenolongError(f"{flag} {source}: {model_dir} has config.json but no *.safetensors weights; the checkpoint is incomplete")
    # By content, not path or mtime: a copied run resumes its evaluation, a rewritten one does not.
    identity = {"model_dir": str(model_dir.resolve()), "fingerprint": model_fingerprint(model_dir)}
    return ModelSpec(source=source, label=label, architecture=arch, token_map=token_map, identity=identity)


def _token_map(state: dict | None, model_dir: Path, vocab_size: int, flag: str, source: str) -> list[int]:
    """What training fed the model: the run's recorded map, else the checkpoint's tokenizer.json,
    else (a DNA-vocabulary model without one) genolong's own ids."""
    ids = (state or {}).get("dna_token_ids")
    if ids is not None:
        return [int(i) for i in ids]
    if vocab_size <= DNA_MODEL_VOCAB_SIZE and not (model_dir / "tokenizer.json").is_file():
        return list(range(len(DNA_BASES)))
    from genolong.model.vocab import checkpoint_base_ids

    try:
        table = checkpoint_base_ids(model_dir, vocab_size)
    except GenolongError as err:
        raise GenolongError(f"{flag} {source}: {err}") from None
    return [table[b] for b in DNA_BASES]


def load(resolved: Resolved, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from genolong.model.checkpoint import from_pretrained

    return from_pretrained(resolved.model_dir, dtype=dtype, device=device).eval()


def scorer(resolved: Resolved, rt, pmesh=None):
    """The scorer of one model for eval-positional and eval-recall: the model loaded in `rt`'s dtype
    on its device (`rt`: a genolong.eval.runtime.Runtime), context parallel over pmesh's "cp" ranks
    when there are several, bits over A, C, G, T (the model's probabilities renormalised over the
    four bases) in loss chunks of `rt.chunk_tokens`."""
    from genolong.eval.positional import ModelScorer
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.options import MemoryOptions

    model = load(resolved, rt.torch_dtype, rt.device)
    context_parallel = pmesh is not None and pmesh.size("cp") > 1
    if context_parallel:
        # Before the memory pass, in the training passes' order (genolong/train/passes.py).
        from genolong.parallel.context import apply_context_parallel

        apply_context_parallel(model, pmesh)
    # As in training, MoE runs over the sequence in chunks: uneven real routing must not spike
    # memory at 512k (the original recipe's real-data MoE chunking). Recompute and offload only
    # matter with a backward pass, and there is none here.
    apply_memory_optimizations(model, MemoryOptions(recompute=False, offload=False, moe_chunking=True).validate())
    token_map = token_map_array(resolved.spec)
    if context_parallel:
        from genolong.eval.context_scorer import ContextParallelScorer
        from genolong.parallel.layout import ParallelLayout, required_multiple

        granule = required_multiple(ParallelLayout(), model.config.dsa.indexer.kpool)
        return ContextParallelScorer(model, token_map, pmesh, granule=granule, device=rt.device, chunk_tokens=rt.chunk_tokens)
    return ModelScorer(model, token_map, device=rt.device, chunk_tokens=rt.chunk_tokens)


def token_map_array(spec: ModelSpec) -> np.ndarray:
    return np.asarray(spec.token_map, dtype=np.int64)
