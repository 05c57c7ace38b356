"""The planted-repeat recall experiment, one arm per invocation: train a model on windows with
planted repeats, then run eval-recall over every finished arm in the output directory.

An arm is a name plus training options; the two arms of the experiment differ only in the
indexer options (`--indexer-loss-coeff 0`, the frozen indexer, vs `> 0`, trained), which pass
straight through to TrainOptions (so they work once the option exists; until then a non-zero
coefficient is refused in one line). Both arms start from the same initial weights
(`OUT/init`, built once from the preset and its overrides), train on the same windows and are
scored on the same planted held-out windows, so they differ only in what the arm changes.

Layout (WORK holds the bulky files, OUT the results; --work defaults to --out):
    WORK/data/          the prepared genome (unless --data is given)
    WORK/init/          the initial model (seeded), shared by the arms
    WORK/ARM/           the finetune run (checkpoints; resumable); its name labels the arm in the plots
    OUT/ARM/arm.json    the arm's options, train wall and process CPU seconds, losses; metrics.jsonl beside it
    OUT/eval/           eval-recall of the initial model and every finished arm in WORK:
                        recall.{csv,json,png}, recall_offsets.csv, summary.txt
    OUT/results.json    per arm: options, timing, recall by distance; OUT/log.txt: the log

recall_cpu.py and recall_gpu.py set the defaults for their machines; see docs/recall.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import time
from pathlib import Path

import torch

from genolong.data import BUNDLED_HOLDOUT, BUNDLED_TRAIN, bundled_genome_path, prepare
from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset, save_pretrained
from genolong.train import checkpoint as ckpt_io
from genolong.train.loop import load_run_options, train
from genolong.train.options import MemoryOptions, TrainOptions
from genolong.units import parse_length


def parser(description: str, **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="results directory (arm records, eval, results.json, log)")
    p.add_argument("--work", default=None, help="directory for data, initial model and runs (default: --out)")
    p.add_argument("--arm", default="frozen", help="this arm's name (a subdirectory of --out)")
    p.add_argument("--data", default=None, help="a prepared genome (default: the bundled one, prepared into OUT/data)")
    p.add_argument("--holdout-cut", type=int, default=None,
                   help="hold out E. coli from this base on (an interval split, for windows longer than lambda's 48.5 kb)")
    p.add_argument("--init-from", default=None,
                   help="start the arm from this model (a finetune run = its latest checkpoint, or a model directory) instead of "
                   "the preset's seeded initialisation")
    p.add_argument("--init-overrides", default=None, metavar="JSON",
                   help="with --init-from: start from its weights in a model whose config is changed by these overrides "
                   "(get_preset's form), e.g. '{\"dsa\": {\"indexer\": {\"topk\": 32}}}' to run a model trained with a dense "
                   "selection sparse; saved once as WORK/init-retargeted, the arms' common start and baseline")
    short = p.add_argument_group("short stage", "a first stage of each arm on short windows (recorded as arm 'ARM-short', with the "
                                 "arm's --indexer-loss-coeff; its warm-up steps belong to the long stage): there the sparse layers' "
                                 "selection covers much of each window, so attention can learn to find a copy's first occurrence "
                                 "before the arm extends to long windows")
    short.add_argument("--short-steps", type=int, default=0, help="0: no short stage")
    short.add_argument("--short-seq", default="128")
    short.add_argument("--short-batch", type=int, default=8)
    short.add_argument("--short-len", type=int, default=32)
    short.add_argument("--short-min-dist", default="32")
    short.add_argument("--short-max-dist", default="95")
    short.add_argument("--short-per-window", type=int, default=2)
    short.add_argument("--short-lr", type=float, default=3e-3)
    short.add_argument("--short-warmup", type=int, default=50)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--preset-overrides", default="{}", help='JSON for get_preset, e.g. \'{"num_layers": 8}\'')
    p.add_argument("--seq", default="2k", help="training window (tokens)")
    p.add_argument("--len", dest="length", type=int, default=64, help="bases per planted copy")
    p.add_argument("--min-dist", default="64")
    p.add_argument("--max-dist", default="1900")
    p.add_argument("--per-window", type=int, default=8)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--indexer-loss-coeff", type=float, default=0.0, help="0 = frozen indexer (no option passed at all)")
    p.add_argument("--indexer-warmup-steps", type=int, default=None)
    p.add_argument("--train-option", action="append", default=[], metavar="KEY=JSON", help="any other TrainOptions field")
    p.add_argument("--memory", default='{"offload": false, "recompute": false}', help="JSON for MemoryOptions")
    p.add_argument("--eval-seq", default=None, help="eval window (default: --seq)")
    p.add_argument("--eval-distances", default="64,256,1k,1900")
    p.add_argument("--eval-len", type=int, default=None, help="default: --len")
    p.add_argument("--eval-skip", type=int, default=16)
    p.add_argument("--eval-windows", type=int, default=23)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--no-eval", action="store_true", help="train only")
    p.add_argument("--prepare-only", action="store_true",
                   help="prepare the data and the initial model, then stop (before arms start side by side, so they do not race)")
    p.add_argument("--eval-only", action="store_true", help="no training: score the initial model and every finished arm in OUT")
    p.add_argument("--eval-short-stages", action=argparse.BooleanOptionalAction, default=True,
                   help="also score every arm's short stage (ARM-short)")
    p.add_argument("--steps-like", default=None, metavar="ARM",
                   help="train as many steps as arm ARM did (its OUT/ARM/arm.json and OUT/ARM-short/arm.json, where they "
                   "exist), so that arms cut short by --budget-s are still compared at equal training")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds for the whole invocation: train in chunks of --chunk-steps and stop early (recorded) "
                   "when the next chunk would not leave --eval-reserve-s for the evaluation")
    p.add_argument("--chunk-steps", type=int, default=50)
    p.add_argument("--eval-reserve-s", type=float, default=90)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.set_defaults(**defaults)
    return p


class Log:
    """Timestamped lines to stdout and OUT/log.txt; `tag` (the arm) tells apart arms that run side by side."""

    def __init__(self, path: Path, tag: str = "") -> None:
        self.path, self.t0, self.tag = path, time.time(), tag

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f} s]{' ' + self.tag if self.tag else ''} {msg}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def prepare_data(args, out: Path, log: Log) -> Path:
    if args.data:
        return Path(args.data)
    data = out / "data"
    if (data / "manifest.json").exists():
        return data
    if args.holdout_cut is None:
        prepare(bundled_genome_path(), data, train=BUNDLED_TRAIN, holdout=BUNDLED_HOLDOUT, progress=False, log=lambda _m: None)
        log(f"prepared the bundled genome into {data} (train E. coli 536, holdout phage lambda)")
        return data
    # Lambda (48.5 kb) is shorter than a 64k window: hold out E. coli's tail instead (an interval
    # split; both occurrences of every planted copy are held-out DNA all the same).
    seqs, name = {}, None
    with gzip.open(bundled_genome_path(), "rt") as f:
        for line in f:
            if line.startswith(">"):
                name = line[1:].split()[0]
                seqs[name] = []
            else:
                seqs[name].append(line.strip())
    ecoli = "".join(seqs[BUNDLED_TRAIN])
    fa = out / "ecoli_split.fa"
    with open(fa, "w") as f:
        for rec, s in (("ecoli_train", ecoli[: args.holdout_cut]), ("ecoli_holdout", ecoli[args.holdout_cut :])):
            f.write(f">{rec}\n" + "\n".join(s[i : i + 80] for i in range(0, len(s), 80)) + "\n")
    prepare(fa, data, train="ecoli_train", holdout="ecoli_holdout", progress=False, log=lambda _m: None)
    fa.unlink()
    log(f"prepared E. coli 536 into {data}: train [0, {args.holdout_cut:,}), holdout [{args.holdout_cut:,}, end)")
    return data


def model_dir(path: Path) -> Path:
    """A finetune run's latest checkpoint model, or the model directory itself."""
    latest = ckpt_io.latest(path) if (path / ckpt_io.CHECKPOINTS).is_dir() else None
    return latest / ckpt_io.MODEL_DIR if latest else path


def initial_model(args, out: Path, log: Log) -> Path:
    init = out / "init"
    if not (init / "config.json").exists():
        overrides = json.loads(args.preset_overrides)
        torch.manual_seed(args.seed)
        model = GenoLongForCausalLM(get_preset(args.preset, **overrides))
        save_pretrained(model, out / "init.tmp")
        (out / "init.tmp").rename(init)
        n = sum(p.numel() for p in model.parameters())
        shown = f"{args.preset} {json.dumps(overrides)}" if overrides else args.preset
        log(f"initial model {shown}: {n:,} parameters -> {init}")
    return init


def retargeted_model(source: Path, overrides: dict, work: Path, log: Log) -> Path:
    """`source`'s weights in a model with its config changed by `overrides`, saved once (the
    record beside it says from what; a different request for the same WORK is refused)."""
    from genolong.model import from_pretrained
    from genolong.model.presets import apply_overrides

    target = work / "init-retargeted"
    request = {"source": str(source.resolve()), "overrides": overrides}
    record = target / "retarget.json"
    if record.exists():
        done = json.loads(record.read_text())
        if done != request:
            raise GenolongError(f"{target} was made from {done}, not {request}; remove it or use another --work")
        return target
    model = from_pretrained(source, dtype=torch.float32)
    changed = GenoLongForCausalLM(apply_overrides(model.config, overrides))
    changed.load_state_dict(model.state_dict())  # the overrides may change what runs, never the weights' shapes
    tmp = work / "init-retargeted.tmp"
    save_pretrained(changed, tmp)
    (tmp / "retarget.json").write_text(json.dumps(request) + "\n")
    tmp.rename(target)
    log(f"initial model: {source} with {json.dumps(overrides)} -> {target}")
    return target


def short_stage_args(args) -> argparse.Namespace:
    """The arm's short stage: the short-* values, the arm's indexer coefficient, no warm-up, no budget chunks."""
    return argparse.Namespace(**{
        **vars(args),
        "arm": f"{args.arm}-short",
        "steps": args.short_steps,
        "seq": args.short_seq,
        "batch": args.short_batch,
        "length": args.short_len,
        "min_dist": args.short_min_dist,
        "max_dist": args.short_max_dist,
        "per_window": args.short_per_window,
        "lr": args.short_lr,
        "warmup": args.short_warmup,
        "indexer_warmup_steps": None,
        "budget_s": None,
    })


def arm_options(args, data: Path, init: Path, run: Path) -> TrainOptions:
    seq = parse_length(args.seq, "--seq")
    fields = {
        "data": str(data),
        "out": str(run),
        "seq_len": seq,
        "preset": None,
        "model_path": str(init),
        "steps": args.steps,
        "lr": args.lr,
        "warmup": args.warmup,
        "batch": args.batch,
        "seed": args.seed,
        "keep_last": 1,
        "progress": False,
        "tensorboard": False,
        "planted_repeats": f"len={args.length},min-dist={args.min_dist},max-dist={args.max_dist},per-window={args.per_window}",
        "memory": MemoryOptions(**json.loads(args.memory)),
    }
    if args.indexer_loss_coeff:
        fields["indexer_loss_coeff"] = args.indexer_loss_coeff
    if args.indexer_warmup_steps is not None:
        fields["indexer_warmup_steps"] = args.indexer_warmup_steps
    for item in args.train_option:
        key, _, value = item.partition("=")
        fields[key] = json.loads(value)
    known = {f.name for f in dataclasses.fields(TrainOptions)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise GenolongError(
            f"this genolong's TrainOptions has no {', '.join(unknown)}: the option has not landed on this branch "
            "(indexer training: indexer_loss_coeff / indexer_warmup_steps); run the frozen arm, or update genolong"
        )
    return TrainOptions(**fields)


def train_arm(args, options: TrainOptions, record_dir: Path, log: Log) -> dict:
    record_path = record_dir / "arm.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        log(f"arm {args.arm}: already trained ({record['steps']} steps, final loss {record['final_loss']:.4f}); delete {record_dir} to retrain")
        return record
    run = Path(options.out)
    resume = run.exists() and ckpt_io.latest(run) is not None
    if run.exists() and not resume:
        raise GenolongError(f"{run} holds a run without a complete checkpoint; remove it to retrain the arm")
    log(f"arm {args.arm}: training {options.steps} steps at {options.seq_len:,} tokens, planted {options.planted_repeats}"
        + (" (resuming)" if resume else ""))
    wall, cpu = time.time(), time.process_time()
    records, stopped_early = _train_within_budget(args, options, run, resume, log)
    wall, cpu = time.time() - wall, time.process_time() - cpu
    metrics_text = (run / ckpt_io.METRICS_FILE).read_text()
    metrics = [json.loads(line) for line in metrics_text.splitlines() if line.strip()]
    times = sorted(r["step_time_s"] for r in records[1:]) or [None]  # step 1 includes compilation
    record = {
        "arm": args.arm,
        "run": str(run),
        "options": options.to_dict(),
        "steps": len(metrics),
        "steps_planned": options.steps,
        "stopped_early_for_time": stopped_early,
        "first_loss": metrics[0]["loss"],
        "final_loss": metrics[-1]["loss"],
        "final_loss_mean_last_10": sum(m["loss"] for m in metrics[-10:]) / len(metrics[-10:]),
        "train_wall_s": wall,
        "train_process_cpu_s": cpu,
        "steps_this_invocation": len(records),
        "median_step_s_after_first": times[len(times) // 2],
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / "metrics.jsonl").write_text(metrics_text)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    log(f"arm {args.arm}: loss {record['first_loss']:.4f} -> {record['final_loss']:.4f} nats in {wall:.0f} s wall, {cpu:.0f} s process CPU")
    return record


def _train_within_budget(args, options: TrainOptions, run: Path, resume: bool, log: Log) -> tuple[list[dict], bool]:
    """Train to the end, or with --budget-s in checkpointed chunks of at most --chunk-steps, each
    sized to leave --eval-reserve-s for the evaluation. Returns this invocation's step records and
    whether it stopped before the planned steps."""
    target = getattr(args, "stop_at", None) or options.steps
    latest = ckpt_io.latest(run) if resume else None
    done = int(ckpt_io.load_trainer_state(latest)["step"]) if latest else 0
    if done >= target:
        return [], False
    if args.budget_s is None:
        cut = {"stop_after": target - done} if target < options.steps else {}
        return train(load_run_options(run, progress=False, **cut) if resume else dataclasses.replace(options, **cut)), False
    records: list[dict] = []
    step_s = overhead_s = None  # measured on the previous chunk (its first step may include compilation)
    while done < target:
        take = min(args.chunk_steps, target - done)
        if step_s is not None:
            left = args.budget_s - (time.time() - log.t0) - args.eval_reserve_s - overhead_s
            take = min(take, int(left // step_s))
            if take < 1:
                log(f"stopping at step {done} of {options.steps}: another step (~{step_s:.1f} s + {overhead_s:.0f} s to "
                    f"reload and save) would not leave {args.eval_reserve_s:.0f} s for the evaluation")
                return records, True
        elif args.budget_s - (time.time() - log.t0) - args.eval_reserve_s < 120:
            # No step time measured yet and little time left (a slow start): a few steps, so that the arm exists.
            take = min(take, 3)
        t0 = time.time()
        if done:
            chunk = train(load_run_options(run, progress=False, stop_after=take))
        else:
            chunk = train(dataclasses.replace(options, stop_after=take))
        elapsed = time.time() - t0
        times = sorted(r["step_time_s"] for r in chunk)
        step_s = times[len(times) // 2]
        overhead_s = max(0.0, elapsed - sum(times))  # model load and checkpoint save (compilation sits in step 1)
        records += chunk
        done = chunk[-1]["step"]
        log(f"step {done}/{options.steps}: loss {chunk[-1]['loss']:.4f}; chunk of {len(chunk)} steps {elapsed:.0f} s "
            f"(median step {step_s:.2f} s)")
    return records, False


def evaluate_arms(args, out: Path, data: Path, init: Path, log: Log) -> dict:
    """eval-recall of the initial model and every arm recorded in OUT whose run is still in WORK."""
    from genolong.cli import app

    records = [json.loads(p.read_text()) for p in sorted(out.glob("*/arm.json"))]
    records = [r for r in records if ckpt_io.latest(Path(r["run"])) is not None]
    scored = [r for r in records if args.eval_short_stages or not r["arm"].endswith("-short")]
    eval_dir = out / "eval"
    argv = ["eval-recall", "--data", str(data), "--baseline", str(init), "--out", str(eval_dir), "--overwrite", "--no-progress",
            "--seq", args.eval_seq or args.seq, "--len", str(args.eval_len or args.length), "--skip", str(args.eval_skip),
            "--distances", args.eval_distances, "--windows", str(args.eval_windows), "--bootstrap", str(args.bootstrap)]
    for r in scored:
        argv += ["--checkpoint", r["run"]]
    wall, cpu = time.time(), time.process_time()
    app(argv, standalone_mode=False)
    wall, cpu = time.time() - wall, time.process_time() - cpu
    log(f"eval-recall of the initial model and {', '.join(r['arm'] for r in scored)}: {wall:.0f} s wall, {cpu:.0f} s process CPU -> {eval_dir}")
    doc = json.loads((eval_dir / "recall.json").read_text())
    role_of = {m["source"]: role for role, m in doc["meta"]["models"].items()}
    results = {
        "eval": {"layout": doc["layout"], "n_windows": len(doc["windows"]), "wall_s": wall, "process_cpu_s": cpu},
        "initial_model": doc["models"]["baseline"],
        "arms": {r["arm"]: {**r, "recall": doc["models"].get(role_of.get(r["run"]))} for r in records},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def steps_like(args, out: Path, stage: str) -> tuple[int, int] | None:
    """(planned, done) steps of --steps-like's arm in this stage ("" or "-short"), if it has been recorded."""
    record = out / f"{args.steps_like}{stage}" / "arm.json"
    if not (args.steps_like and record.exists()):
        return None
    r = json.loads(record.read_text())
    return r["steps_planned"], r["steps"]


def main(args) -> int:
    out = Path(args.out)
    work = Path(args.work or args.out)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out / "log.txt", tag="" if args.prepare_only or args.eval_only else args.arm)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        data = prepare_data(args, work, log)
        # (with --init-from the arms start from that model: no seeded one is built)
        init = initial_model(args, work, log) if not args.init_from else None
        if args.prepare_only:
            return 0
        # The arms' common start (the seeded initial model, or --init-from's) is the baseline they are scored against.
        baseline = model_dir(Path(args.init_from)) if args.init_from else init
        if args.init_overrides:
            if not args.init_from:
                raise GenolongError("--init-overrides changes the config of --init-from's model; without it use --preset-overrides")
            baseline = retargeted_model(baseline, json.loads(args.init_overrides), work, log)
        if args.eval_only:
            evaluate_arms(args, out, data, baseline, log)
            return 0
        start = baseline
        # The same learning-rate schedule, cut where the other arm was cut.
        args.stop_at = None
        if like := steps_like(args, out, "-short"):
            args.short_steps = like[1]
        if like := steps_like(args, out, ""):
            args.steps, args.stop_at = like
        if args.short_steps:
            short = short_stage_args(args)
            options = arm_options(short, data, start, work / short.arm)
            options.validate()
            train_arm(short, options, out / short.arm, log)
            start = model_dir(work / short.arm)
        options = arm_options(args, data, start, work / args.arm)
        options.validate()
        train_arm(args, options, out / args.arm, log)
        if not args.no_eval:
            evaluate_arms(args, out, data, baseline, log)
    except GenolongError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
