"""The training loop: `train(options) -> per-step records`, on one device, no process groups.

One step (docs/training.md):
1. take `batch` windows of seq_len + 1 bases (inputs = the first seq_len, targets = shifted by
   one), count the step's valid targets (not N) once;
2. for each of `grad_accum` micro-batches: hidden states, chunked LM loss divided by that
   global count, backward (gradients add up to the gradient of the step's mean loss);
3. global gradient norm; a non-finite loss or norm skips the update (counted; the run stops
   with the reason after `max_nonfinite` in a row); otherwise clip and take an AdamW step at
   the scheduled learning rate, then move the MoE routers' correction biases towards an even
   expert load (genolong.train.balance);
4. one record: loss, lr, grad norm, tokens/s, MFU/HFU, peak GPU memory, pinned host bytes;
   JSONL, TensorBoard, progress bar; a checkpoint every `save_every` steps and at the end.
With `indexer_loss_coeff > 0` the DSA indexer trains too (genolong/train/indexer.py): its KL
loss joins step 2 (or, during the indexer warm-up, replaces the LM backward: only the indexer
updates in step 3), and the record carries its loss and, every `indexer_recall_every` steps, its
recall.

Everything a step depends on is either in the checkpoint (weights, optimizer, sampler position,
RNG states, counters) or a pure function of the options (the schedule), so a resumed run
repeats the uninterrupted run's losses exactly on CPU.

Across processes (torchrun or --launcher ray; docs/parallel.md) the same loop runs on every rank:
genolong.train.distributed joins the process group and builds the mesh, genolong.train.passes
applies every pass (kernel policy, tensor/expert/context parallel, MoE chunking, recompute,
offload, compile, gradient sync) in its fixed order, each "batch" rank reads its own windows and
each cp rank its shard of them (genolong.parallel.data), the valid count and the loss are summed
over the "loss" group, gradients over their groups, rank 0 writes the logs, and checkpoints are
written with torch.distributed.checkpoint (genolong.parallel.checkpoint). With one process and no
process group this is exactly the single-device loop (no collective is made).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from genolong import checkpoint_dir
from genolong.errors import GenolongError
from genolong.kernels.kda import prebuild as kda_prebuild
from genolong.model import ops
from genolong.parallel import checkpoint as dist_ckpt
from genolong.parallel.context import shard_batch, shard_sequence
from genolong.parallel.data import load_sampler_state, sampler_state
from genolong.train import checkpoint as ckpt_io
from genolong.train import distributed
from genolong.train.balance import ExpertBalancer
from genolong.train.flops import peak_flops, step_flops
from genolong.train.host_allocator import keep_freed_host_memory
from genolong.model.presets import set_indexer_topk
from genolong.train.copy_oracle import oracle_keys, selection_oracle
from genolong.train.indexer import IndexerTraining, trainable_parameters
from genolong.train.loss import (
    auto_chunk_tokens,
    chunked_lm_loss,
    full_lm_loss,
    repeat_target_weight,
)
from genolong.train.metrics import JsonlLog, StepRecord, TensorBoardLog
from genolong.train.optim import MasterAdamW, clip_scale, lr_at
from genolong.train.progress_lines import progress_display
from genolong.train.plan import moe_chunks_checkpointed
from genolong.train.passes import parallelize
from genolong.train.options import TrainOptions
from genolong.train.resolve import RunSpec, open_sampler, resolve
from genolong.vocab import N_ID

log = logging.getLogger("genolong.train")
GIB = 1024**3


class TrainingStopped(GenolongError):
    """The run stopped on purpose (too many non-finite steps); the message says why."""

    keeps_run = True  # its logs show the divergence: never cleaned up with the refused inputs


@dataclass
class _Batch:
    inputs: torch.Tensor  # [b, T] token ids the model reads (checkpoint ids when fine-tuning a GLM)
    targets: torch.Tensor  # [b, T]
    valid: torch.Tensor  # [b, T] bool: target is not N
    weight: torch.Tensor | None = None  # [b, T] fp32 loss weight per target (--repeat-weight); None = 1 where valid
    oracle: torch.Tensor | None = None  # [b, T] int64 key each query copies from (--copy-oracle); None = off


def check_inputs(options: TrainOptions) -> RunSpec:
    """Every check that needs no model weights and no device, and the run resolved
    (genolong.train.resolve): run by the launcher before it starts a worker, so that bad input is
    one line at once; `train` takes the result rather than checking twice in one process."""
    return resolve(options)


def train(options: TrainOptions, spec: RunSpec | None = None) -> list[dict]:
    """Run, or with `options.resume` continue, the run in `options.out`; return this invocation's records
    (on every rank of a multi-process run; rank 0 writes the logs). `spec`: `check_inputs(options)`
    when the caller has run it in this process already.

    The run directory is locked for the whole call (genolong.train.checkpoint.locked; by rank 0 in a
    multi-process run: the other ranks do not write in it but through rank 0 or into checkpoints)."""
    if spec is None or spec.options is not options:
        spec = check_inputs(options)
    with ckpt_io.locked(options.out) if distributed.launched_rank() == 0 else contextlib.nullcontext():
        return _train_locked(spec)


def _train_locked(spec: RunSpec) -> list[dict]:
    default_cuda_allocator()
    procs = distributed.start(spec.options, spec.device)
    finished = False
    try:
        records = _train(spec.on_device(procs.device), procs)
        finished = True
        return records
    finally:
        procs.close(finished)


def _restart_hint(run_dir: Path) -> str:
    """Where a new run after a divergence starts from (--resume keeps the run's own --lr)."""
    last = ckpt_io.latest(run_dir)
    if last is None:
        return " (no checkpoint was saved: the same command plus --overwrite and a lower --lr)"
    return f" from its last good checkpoint: --model {last / ckpt_io.MODEL_DIR} --out <a new run>"


def _train(spec: RunSpec, procs: distributed.Processes) -> list[dict]:
    options, device = spec.options, spec.device
    if device.startswith("cpu"):
        keep_freed_host_memory()  # genolong/train/host_allocator.py: ~14k page faults per 2k tiny step otherwise
    run_dir = Path(options.out)
    if options.resume and ckpt_io.check_run_dir(run_dir) != spec.resume_from:
        # A checkpoint completed between the check and taking the lock: resolve against it.
        spec = check_inputs(options).on_device(device)
    resume_from = spec.resume_from
    # Before the run directory is touched: a run refused for memory leaves nothing to clean up.
    layout = procs.layout
    if layout.cp == layout.tp == layout.ep == layout.fsdp == 1:
        # The plan assumes one whole sequence per GPU; split layouts have their own plan (genolong plan --parallel).
        spec = spec.planned()
    # Every rank has checked --out before rank 0 changes anything there.
    procs.barrier()
    if procs.main:
        _prepare_run_dir(run_dir, options, resume_from)
        _write_plan(run_dir, spec.plan)

    _seed_everything(options.seed)
    sampler = open_sampler(options, *procs.coords("batch"))
    model, dna_map = _build_model(spec, procs)
    parallel = parallelize(model, options, procs.pmesh, kernels=spec.kernels)
    if _on_meta(model):
        _materialise(model, options, device, resume_from, parallel)
    handle = parallel.memory
    # fla's TileLang KDA backward builds while the first forward runs (genolong/kernels/kda/prebuild.py).
    prebuild = None
    if device.startswith("cuda") and parallel.policy.name != ops.REFERENCE:
        prebuild = kda_prebuild.start(model.config, device=device, dtype=spec.dtype, tp=layout.tp, cp=layout.cp)
    balancer = ExpertBalancer(model, rate=options.balance_rate, aux_loss_coeff=options.aux_loss_coeff)
    indexer = IndexerTraining(
        model,
        coeff=options.indexer_loss_coeff,
        warmup_steps=options.indexer_warmup_steps,
        recall_every=options.indexer_recall_every,
        recall_queries=options.indexer_recall_queries,
        query_fraction=options.indexer_loss_queries,
        seed=options.seed,
    )
    optimizer = MasterAdamW(
        trainable_parameters(model, train_indexer=indexer.trains),
        lr=options.lr,
        betas=(options.beta1, options.beta2),
        eps=options.eps,
        weight_decay=options.weight_decay,
    )
    start, nonfinite_total, nonfinite_run = 0, 0, 0
    if resume_from is not None:
        state = _restore(resume_from, model, optimizer, procs)
        if options.overfit == 0:
            load_sampler_state(sampler, ckpt_io.from_jsonable(state["sampler"]))
        start = int(state["step"])
        nonfinite_total, nonfinite_run = int(state["nonfinite_total"]), int(state["nonfinite_run"])
        log.info("resumed %s at step %d", run_dir, start)
        if start >= options.steps:
            _notice(f"{run_dir} has finished all {options.steps} steps; nothing to do (give --steps N to train further)")

    if procs.main and start == 0 and options.warmup >= options.steps - 1 and options.steps > 1:
        # lr_at: the cosine needs two steps after the warmup to reach --lr and then base x min ratio.
        _notice(
            f"--warmup {options.warmup} with --steps {options.steps}: the run ends "
            + ("inside the warmup, below --lr" if options.warmup >= options.steps else "at --lr, before any decay")
            + f"; give --warmup {max(options.steps - 2, 0)}{' or less' if options.steps > 2 else ''} for a cosine decay to the end"
        )
    batches = _batches(options, sampler, dna_map, device, start, procs)
    chunk = options.memory.loss_chunk_tokens or auto_chunk_tokens(model.config.vocab_size)
    flops = step_flops(
        model.config,
        options.seq_len,
        recompute=options.memory.recompute,
        chunked_loss=options.memory.chunked_loss,
        # (with the MoE outputs kept the layer's recompute skips the MoE: the chunks' run is the recompute's)
        # (the MoE sees one micro-batch of this rank's sequences at a time, so that decides its chunking)
        moe_recompute=moe_chunks_checkpointed(
            options.batch // (procs.layout.data_parallel * options.grad_accum) * options.seq_len, options.memory
        ) and not options.memory.keeps_moe(),
    ).scaled(options.batch)
    peak = peak_flops(torch.cuda.get_device_name(device) if device.startswith("cuda") else None)
    peak = peak * procs.world if peak else peak
    end = options.steps if options.stop_after is None else min(options.steps, start + options.stop_after)

    if procs.main:
        jsonl = JsonlLog(run_dir / ckpt_io.METRICS_FILE, truncate_after_step=start if resume_from is not None else None)
        tensorboard = TensorBoardLog(run_dir, options.tensorboard)
        progress = progress_display(options.steps, start, options.progress, compiling=device.startswith("cuda"))
    else:
        jsonl = tensorboard = progress = _Discard()
    ctx = _StepContext(model=model, optimizer=optimizer, options=options, device=device, parallel=parallel, indexer=indexer,
                       procs=procs, balancer=balancer, loss_chunk=chunk, flops=flops, peak_flops=peak, prebuild=prebuild)
    records: list[dict] = []
    parallel.policy.reset_audit()
    model.train()
    try:
        for step in range(start, end):
            batch = next(batches)
            record = _train_step(ctx, batch, step)
            nonfinite_run = nonfinite_run + 1 if record.skipped else 0
            nonfinite_total += int(record.skipped)
            record.nonfinite_total = nonfinite_total
            jsonl.write(record)
            tensorboard.write(record)
            progress.update(record)
            records.append(record.__dict__.copy())
            if step == start and procs.main:
                _write_kernel_audit(run_dir, parallel.policy)
                _write_memory_setup(run_dir, handle)
                _write_compile_setup(run_dir, parallel.compiled, prebuild)
            if nonfinite_run >= options.max_nonfinite:
                raise TrainingStopped(
                    f"stopped at step {step + 1}: {nonfinite_run} consecutive steps had a non-finite loss or gradient "
                    f"(last loss {record.loss}, grad norm {record.grad_norm}); check the data, or start a new run with a lower "
                    f"--lr{_restart_hint(run_dir)}"
                )
            done = step + 1
            if done == end or (options.save_every and done % options.save_every == 0):
                if done == end:
                    # The pinned pool is not needed again in this process, and the save copies the fp32 master
                    # weights and moments (12 bytes a parameter) to host memory, serialised as much again:
                    # at 1M the pool alone is ~100 GiB of the device machine's ~125 GiB of RAM.
                    handle.release_host()
                _save(run_dir, done, model, optimizer, sampler, options, dna_map, nonfinite_total, nonfinite_run, procs)
    finally:
        indexer.clear()
        progress.close()
        jsonl.close()
        tensorboard.close()
        balancer.remove()
        # Gives the pinned host pool back now: a benchmark calling train() repeatedly in one
        # process would otherwise hold one pool per run until garbage collection.
        parallel.remove()
    return records


def _prepare_run_dir(run_dir: Path, options: TrainOptions, resume_from: Path | None) -> None:
    """A new run's directory (replacing an earlier run with --overwrite), or a resumed one tidied."""
    if resume_from is None:
        if options.overwrite:
            ckpt_io.clear_for_overwrite(run_dir)
        else:
            ckpt_io.refuse_occupied(run_dir)  # again, under the lock
        _start_run_dir(run_dir, options)
    else:
        ckpt_io.remove_stale_temporaries(run_dir)
        _record_resume_changes(run_dir, options, resume_from)


class _Discard:
    """The logs of ranks other than 0: every record is rank 0's already (global sums)."""

    def write(self, record) -> None:
        pass

    def update(self, record) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _StepContext:
    """What every step of a run uses, set up once by `_train`."""

    model: torch.nn.Module
    optimizer: MasterAdamW
    options: TrainOptions
    device: str
    parallel: object  # genolong.train.passes.Parallelized
    indexer: IndexerTraining
    procs: distributed.Processes
    balancer: ExpertBalancer | None
    loss_chunk: int  # tokens per chunk of the chunked loss head
    flops: object  # genolong.train.flops.StepFlops of one optimizer step
    peak_flops: float | None  # the world's peak FLOP/s (None: unknown device, no MFU)
    prebuild: kda_prebuild.KDABackwardPrebuild | None = None  # joined before the first backward


def _train_step(ctx: _StepContext, batch_list: list[_Batch], step: int) -> StepRecord:
    model, optimizer, options, device, parallel = ctx.model, ctx.optimizer, ctx.options, ctx.device, ctx.parallel
    indexer, procs, balancer, chunk, flops, peak = ctx.indexer, ctx.procs, ctx.balancer, ctx.loss_chunk, ctx.flops, ctx.peak_flops
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    handle = parallel.memory
    handle.reset_stats()
    t0 = time.perf_counter()
    # One count of valid targets for the whole step, every rank's tokens once (docs/parallel.md).
    local_valid = torch.tensor(sum(int(b.valid.sum()) for b in batch_list), dtype=torch.int64, device=device)
    valid_count = int(procs.sum(local_valid))
    # Weighted targets (--repeat-weight): the loss divides by the step's total weight instead (summed over ranks too).
    normaliser = valid_count
    if batch_list[0].weight is not None:
        local_weight = torch.tensor(sum(float(b.weight.sum(dtype=torch.float64)) for b in batch_list), dtype=torch.float64, device=procs._reduce_device())
        normaliser = float(procs.sum(local_weight))
    if balancer is not None:
        balancer.begin_step(options.batch * options.seq_len, options.seq_len)
    # The indexer's KL is already the whole sequence's on every cp rank (genolong/model/piece.py):
    # each batch rank's sequences weigh 1 / (batch ranks), whatever cp splits them into.
    batch_ranks = procs.coords("batch")[1]
    total = torch.zeros((), dtype=torch.float32, device=device)
    indexer.begin_step(step)
    for micro in batch_list:
        indexer.micro_batch(1 / (len(batch_list) * batch_ranks))
        # The oracle stays set through the backward: a layer recomputed there must select what its forward did.
        with selection_oracle(model, micro.oracle):
            with indexer.forward_context():
                hidden = model.hidden_states(micro.inputs)
                weight = model.lm_head.weight
                if options.memory.chunked_loss:
                    loss = chunked_lm_loss(
                        hidden, weight, micro.targets, micro.valid, chunk, global_valid_count=normaliser, target_weight=micro.weight
                    )
                else:
                    loss = full_lm_loss(hidden, weight, micro.targets, micro.valid, global_valid_count=normaliser, target_weight=micro.weight)
            if ctx.prebuild is not None:
                ctx.prebuild.wait()
            if indexer.backward_lm_loss():
                loss.backward()
        total += loss.detach()
        del hidden, loss
    loss_value = float(procs.sum(total))
    if parallel.grads is not None:
        parallel.grads.reduce()
        grad_norm = parallel.grads.grad_norm(optimizer.grad_norm)
    else:
        grad_norm = optimizer.grad_norm()
    lr = lr_at(step, options.lr, options.warmup, options.steps, options.min_lr_ratio)
    # Every rank holds the same summed loss and global norm, so every rank makes the same decision.
    skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step(lr, clip_scale(grad_norm, options.grad_clip), only=indexer.update_only())
    optimizer.zero_grad()
    # The bias moves only with an update of the whole model: a skipped step changes nothing, and
    # during the indexer warm-up the rest of the model (routers included) stays frozen. Every rank
    # sums the expert loads over the ranks routing other tokens, so all apply the same update.
    update_bias = not skipped and indexer.update_only() is None
    reduce = procs.expert_count_reducer() if procs.pmesh is not None else None
    balance = balancer.finish_step(update_bias=update_bias, reduce=reduce) if balancer is not None else None
    indexer_metrics = distributed_indexer_metrics(indexer.end_step(), procs)
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    tokens = options.batch * options.seq_len
    peak_gpu, reserved_gpu, pinned = procs.max_over_ranks([
        torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
        _host_peak(handle),
    ])
    return StepRecord(
        step=step + 1,
        loss=loss_value,
        lr=lr,
        grad_norm=grad_norm,
        skipped=skipped,
        tokens=tokens,
        valid_tokens=valid_count,
        step_time_s=elapsed,
        tokens_per_s=tokens / elapsed,
        model_tflops=flops.model / 1e12,
        hardware_tflops=flops.hardware / 1e12,
        mfu=flops.model / elapsed / peak if peak else None,
        hfu=flops.hardware / elapsed / peak if peak else None,
        peak_gpu_gib=peak_gpu,
        reserved_gpu_gib=reserved_gpu,
        pinned_host_gib=pinned,
        nonfinite_total=0,
        aux_loss=balance.aux_loss if balance is not None else None,
        expert_load_max=_by_layer(balance.load_max) if balance is not None else None,
        expert_load_min=_by_layer(balance.load_min) if balance is not None else None,
        **indexer_metrics,
    )


def distributed_indexer_metrics(metrics: dict, procs) -> dict:
    """The indexer's per-layer KL (each batch rank's share of the step mean) summed over the "batch"
    ranks, its recall averaged over them; unchanged for one process. Both are already summed over
    the cp ranks of a sequence by the layers themselves (genolong/model/piece.py)."""
    if procs.pmesh is None:
        return metrics
    ranks = procs.coords("batch")[1]
    for key, scale in (("indexer_loss", 1.0), ("indexer_recall", 1.0 / ranks)):
        layers = metrics.get(f"{key}_layers")
        if not layers:
            continue
        names = sorted(layers)
        summed = procs.sum(torch.tensor([layers[n] for n in names], dtype=torch.float64, device=procs._reduce_device()), "batch") * scale
        metrics[f"{key}_layers"] = {n: float(v) for n, v in zip(names, summed.tolist(), strict=True)}
        metrics[key] = sum(metrics[f"{key}_layers"].values()) / len(names)
    return metrics


def _by_layer(values: dict[int, float]) -> dict[str, float]:
    """JSON object keys are strings: {"3": 1.42, ...} per MoE layer."""
    return {str(layer): value for layer, value in values.items()}


# ------------------------------------------------------------------------------ set-up pieces


def default_cuda_allocator(environ=os.environ) -> bool:
    """Use the CUDA caching allocator's expandable segments unless the user configured the
    allocator; returns whether it set them. Measured on the H200 at 512k (2026-11-30): reserved minus allocated memory 17.7 GiB without, 5.3 GiB with. The setting is read
    when CUDA first allocates, so it only takes effect before that (the worker process's case)."""
    if any(name in environ for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return False
    if torch.cuda.is_initialized():
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def _start_run_dir(run_dir: Path, options: TrainOptions) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = options.to_dict()
    saved["resume"] = False
    saved["overwrite"] = False
    _write_options(run_dir, saved)


def _write_options(run_dir: Path, saved: dict) -> None:
    tmp = run_dir / f".{ckpt_io.OPTIONS_FILE}.tmp"
    tmp.write_text(json.dumps(saved, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / ckpt_io.OPTIONS_FILE)


# Options a resumed run may change that belong to the run, not to one invocation: written back
# to options.json so that the next --resume keeps them (docs/training.md, "Resume").
RESUME_PERSISTED = ("steps", "save_every", "keep_last")


def _record_resume_changes(run_dir: Path, options: TrainOptions, resume_from: Path) -> None:
    saved = json.loads((run_dir / ckpt_io.OPTIONS_FILE).read_text(encoding="utf-8"))
    at = int(checkpoint_dir.load_trainer_state(resume_from)["step"])
    if options.steps < at:
        raise GenolongError(f"--steps {options.steps} is below the step the run has reached ({at}); give --steps {at} or more")
    changed = {k: getattr(options, k) for k in RESUME_PERSISTED if saved.get(k) != getattr(options, k)}
    if not changed:
        return
    for key, value in changed.items():
        flag = "--" + key.replace("_", "-")
        _notice(f"{flag} {value} (the run had {saved.get(key)}), from step {at} on")
    if "steps" in changed and at < options.steps:
        was = lr_at(at, options.lr, options.warmup, saved["steps"], options.min_lr_ratio)
        now = lr_at(at, options.lr, options.warmup, options.steps, options.min_lr_ratio)
        if f"{now:.3g}" != f"{was:.3g}":  # inside the warmup the rate does not depend on --steps
            _notice(
                f"the learning-rate schedule is re-derived for {options.steps} steps (same warmup, cosine to the new last "
                f"step): the rate at step {at + 1} is {now:.3g} instead of {was:.3g}"
            )
    _write_options(run_dir, {**saved, **changed})


def _notice(message: str) -> None:
    print(f"genolong: {message}", file=sys.stderr, flush=True)


def load_run_options(run_dir: str | Path, **overrides) -> TrainOptions:
    """The options a run was started with, marked for resume, with launch-time `overrides`
    (device, progress, stop_after, launcher, ...) applied."""
    ckpt_io.check_run_dir(run_dir)
    saved = json.loads((Path(run_dir) / ckpt_io.OPTIONS_FILE).read_text(encoding="utf-8"))
    options = TrainOptions.from_dict(saved)
    options.out = str(run_dir)
    options.resume = True
    for key, value in overrides.items():
        setattr(options, key, value)
    return options


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build_model(spec: RunSpec, procs=None):
    """(model, DNA -> token id map or None). Order: resume checkpoint, then --model, then --preset
    (the model `spec.config` describes). A multi-process checkpoint's weights are loaded later
    (`_restore`), into the model after its parallel passes; with tp, ep or fsdp the model comes back
    on the meta device (`_materialise`). The memory pre-flight has run before (`_train`, before the
    run directory is touched)."""
    from genolong.model import GenoLongForCausalLM, from_pretrained
    from genolong.model.vocab import dna_to_checkpoint_ids

    options, device, dtype, resume_from = spec.options, spec.device, spec.dtype, spec.resume_from
    dna_map = None
    # With tp, ep or fsdp a rank holds part of the weights: it builds on the meta device and
    # allocates and reads only its slices after the passes (_materialise).
    sharded = _loads_sharded(procs)
    if resume_from is not None and dist_ckpt.is_distributed(resume_from):
        model = dist_ckpt.build_model(resume_from, dtype, "meta" if sharded else device)
        ids = checkpoint_dir.load_trainer_state(resume_from).get("dna_token_ids")
        dna_map = torch.tensor(ids, dtype=torch.long) if ids is not None else None
    elif resume_from is not None or options.model_path:
        source = resume_from / ckpt_io.MODEL_DIR if resume_from is not None else Path(options.model_path)
        if sharded:
            from genolong.parallel.sharded_load import build_meta

            # The checkpoint's config as resolved, named as from_pretrained names it.
            model = build_meta(dataclasses.replace(spec.config, name=source.name), dtype)
        else:
            model = from_pretrained(source, dtype=dtype, device=device)
        if resume_from is not None:
            ids = checkpoint_dir.load_trainer_state(resume_from).get("dna_token_ids")
            dna_map = torch.tensor(ids, dtype=torch.long) if ids is not None else None
        else:
            dna_map = dna_to_checkpoint_ids(source, vocab_size=model.config.vocab_size)
    else:
        with torch.device(device):
            model = GenoLongForCausalLM(spec.config, dtype=dtype)
    if options.indexer_topk is not None:
        set_indexer_topk(model, options.indexer_topk)
    if dna_map is not None:
        dna_map = dna_map.to(device)
    return model, dna_map


def _loads_sharded(procs) -> bool:
    """Whether this run's ranks build the model on the meta device and read only their slices
    (genolong.parallel.sharded_load): whenever a rank holds part of the weights (tp, ep, fsdp)."""
    if procs is None or procs.pmesh is None:
        return False
    layout = procs.layout
    return layout.tp > 1 or layout.ep > 1 or layout.fsdp > 1


def _on_meta(model) -> bool:
    return next(model.parameters()).device.type == "meta"


def _materialise(model, options: TrainOptions, device: str, resume_from: Path | None, parallel) -> None:
    """Allocate this rank's slices of a meta-built, parallelised model and fill them: from --model
    (or a one-process checkpoint being resumed) by reading only those slices; a multi-process
    checkpoint fills them later in _restore."""
    from genolong.parallel.grad_sync import GradientSync
    from genolong.parallel.sharded_load import load_pretrained_sharded, materialise

    materialise(model, device)
    if resume_from is None or not dist_ckpt.is_distributed(resume_from):
        source = resume_from / ckpt_io.MODEL_DIR if resume_from is not None else Path(options.model_path)
        report = load_pretrained_sharded(model, source, parallel.pmesh)
        log.info(report.summary(source))
    # The sync lists the parameters as they are after to_empty.
    parallel.grads = GradientSync(model, parallel.pmesh)


def _restore(ckpt: Path, model, optimizer, procs) -> dict:
    """Weights (multi-process format), optimizer and RNG from `ckpt`, saved at any layout; returns its trainer state."""
    if dist_ckpt.is_distributed(ckpt):
        state = dist_ckpt.load(ckpt, model=model, optimizer=optimizer, pmesh=procs.pmesh)
        dist_ckpt.restore_rng(ckpt)
        return state
    state = checkpoint_dir.load_trainer_state(ckpt)
    saved = ckpt_io.load_optimizer_state(ckpt, procs.device)
    try:
        if procs.pmesh is not None and (procs.layout.tp > 1 or procs.layout.ep > 1 or procs.layout.fsdp > 1):
            from genolong.parallel.tensor_state import load_full_state

            # A one-process checkpoint holds whole tensors: each rank keeps its part (tp / ep part, fsdp chunk).
            local = optimizer.state_dict()
            load_full_state({k: v for k, v in local.items() if not k.startswith("step")}, saved, procs.pmesh)
            saved = {**local, **{k: v for k, v in saved.items() if k.startswith("step")}}
        optimizer.load_state_dict(saved)
    except (KeyError, RuntimeError, GenolongError) as err:
        raise GenolongError(f"--resume {ckpt.parent.parent}: the optimizer state of {ckpt.name} does not match the model ({err})") from None
    checkpoint_dir.restore_rng(state["rng"])
    return state


def _write_compile_setup(run_dir: Path, compiled, prebuild=None) -> None:
    """What the compile pass replaced and what dynamo did during the first step (graphs, breaks), and
    how the KDA backward's ahead-of-time build went."""
    if compiled is not None or prebuild is not None:
        setup = compiled.describe() if compiled is not None else {}
        if prebuild is not None:
            setup["kda_backward_prebuild"] = prebuild.describe()
        (run_dir / "compile.json").write_text(json.dumps(setup, indent=1) + "\n", encoding="utf-8")


def _host_peak(handle) -> float | None:
    stats = getattr(handle, "stats", None)
    peak = getattr(stats, "peak_pinned_bytes", None)
    return peak / GIB if peak is not None else None


def _batches(options: TrainOptions, sampler, dna_map, device: str, start: int, procs):
    """Infinite iterator of this rank's steps from step `start` on; a step is a list of `grad_accum`
    micro-batches of this rank's windows (its share of the step's `batch`, genolong.parallel.data)."""
    rank, ranks = procs.coords("batch")  # the sampler's sharding (open_sampler)
    cp = procs.coords("cp")
    if options.overfit:
        # The fixed set is the run's first windows (same seed -> same set on resume, at any layout).
        fixed = [_window(sampler, k) for k in range(options.overfit)]
        k = start * options.batch % len(fixed)
        while True:
            take = [fixed[(k + i) % len(fixed)] for i in range(options.batch)]
            k = (k + options.batch) % len(fixed)
            yield _split(take[rank::ranks], options, dna_map, device, cp)
    windows = iter(sampler)
    while True:
        yield _split([next(windows) for _ in range(options.batch // ranks)], options, dna_map, device, cp)


def _window(sampler, k: int):
    """Window k of the run, whatever rank `sampler` is, planted when it plants (PlantedRepeatSampler)."""
    base = getattr(sampler, "base", None)
    return sampler.plant(base.window(k)) if base is not None else sampler.window(k)


def _split(windows, options: TrainOptions, dna_map, device: str, cp: tuple[int, int] = (0, 1)) -> list[_Batch]:
    tokens = torch.from_numpy(np.stack([np.asarray(w.tokens, dtype=np.uint8) for w in windows])).long()
    if tokens.shape[1] != options.seq_len + 1:
        raise GenolongError(f"the sampler returned windows of {tokens.shape[1]} bases, expected {options.seq_len + 1}")
    # Shifted before the cp sharding: the last target of a shard is the first input of the next.
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    valid = targets != N_ID
    weight = None
    if options.repeat_weight != 1.0:
        repeats = torch.from_numpy(np.stack([np.asarray(w.repeat_mask, dtype=bool) for w in windows]))[:, 1:]
        weight = repeat_target_weight(valid, repeats, options.repeat_weight)
    if dna_map is not None:
        inputs, targets = dna_map.cpu()[inputs], dna_map.cpu()[targets]
    inputs, targets, valid = shard_batch(inputs, targets, valid, *cp)
    if weight is not None:
        weight = shard_sequence(weight, *cp)
    oracle = None
    if options.copy_oracle:
        # From the DNA ids (before any checkpoint id map), per whole window: cp is refused with the oracle.
        oracle = torch.from_numpy(oracle_keys(tokens[:, :-1].numpy(), options.copy_oracle))
    micro = len(windows) // options.grad_accum
    return [
        _Batch(
            inputs[i : i + micro].to(device, non_blocking=True),
            targets[i : i + micro].to(device, non_blocking=True),
            valid[i : i + micro].to(device, non_blocking=True),
            weight[i : i + micro].to(device, non_blocking=True) if weight is not None else None,
            oracle[i : i + micro].to(device, non_blocking=True) if oracle is not None else None,
        )
        for i in range(0, len(windows), micro)
    ]


def _write_kernel_audit(run_dir: Path, policy: ops.KernelPolicy) -> None:
    """Which implementation each hot op ran, per layer count (the original recipe's lesson: verify the kernels)."""
    summary = policy.audit_summary()
    (run_dir / "kernels.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if summary:
        log.info("kernels: %s", summary)


def _write_plan(run_dir: Path, plan) -> None:
    """The pre-flight's estimate this invocation runs under (bytes; with the tile and kept results that
    `--tile auto` may have chosen), beside the measured peaks of metrics.jsonl: the plan-vs-measured
    check needs both from the same run. None (a split layout: no one-GPU plan): nothing written."""
    if plan is None:
        return
    saved = {**plan.as_dict(), "fits": plan.fits, "tile_tokens": plan.opts.tile_tokens, "keep_sparse": plan.opts.keep_sparse}
    (run_dir / "plan.json").write_text(json.dumps(saved, indent=1) + "\n", encoding="utf-8")


def _write_memory_setup(run_dir: Path, handle) -> None:
    """What the memory optimizations actually did (offloaded layers are chosen at the first forward)."""
    if handle is not None and hasattr(handle, "describe"):
        (run_dir / "memory.json").write_text(json.dumps(handle.describe(), indent=1) + "\n", encoding="utf-8")


def _save(run_dir, step, model, optimizer, sampler, options, dna_map, nonfinite_total, nonfinite_run, procs) -> None:
    from genolong.model import save_pretrained

    tokenizer = Path(options.model_path) / "tokenizer.json" if options.model_path and dna_map is not None else None
    if tokenizer is not None and not tokenizer.is_file():
        tokenizer = None

    def write_model(path: Path) -> None:
        save_pretrained(model, path)
        if tokenizer is not None:
            shutil.copy2(tokenizer, path / "tokenizer.json")

    state = {
        "step": step,
        "schedule": {"lr": options.lr, "warmup": options.warmup, "steps": options.steps, "min_lr_ratio": options.min_lr_ratio},
        "sampler": ckpt_io.to_jsonable(sampler_state(sampler)) if options.overfit == 0 else None,
        "nonfinite_total": nonfinite_total,
        "nonfinite_run": nonfinite_run,
        "dna_token_ids": dna_map.tolist() if dna_map is not None else None,
    }
    if procs.pmesh is None:
        ckpt_io.save(run_dir, step, write_model, optimizer.state_dict(), {**state, "rng": checkpoint_dir.capture_rng()}, options.keep_last)
        return
    state["layout"] = str(procs.layout)
    extra = {"tokenizer.json": tokenizer} if tokenizer is not None else None
    dist_ckpt.save(run_dir, step, model=model, optimizer=optimizer, trainer_state=state, pmesh=procs.pmesh,
                   keep_last=options.keep_last, extra_files=extra)
