"""The eval-positional job: tile, score every model on every window (resumably), aggregate, write.

Models are scored one after the other, never together: only one model is in memory at a time
(a GLM-size checkpoint and its baseline would not fit side by side), and each finished window
is appended to the partial file before the next starts. The Markov yardstick is scored on the
same windows at the end (milliseconds per window, so it is not stored). Outputs
(positional.csv, positional.json, positional.png, summary.txt) are written atomically at the
end, from the partial file, so a rerun after an interruption, or with a larger --max-windows,
only scores what is missing.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from genolong.errors import GenolongError
from genolong.eval import report
from genolong.eval.markov import MarkovModel
from genolong.eval.plot import plot_positional
from genolong.eval.positional import Layout, ModelScorer, reduce_window, score_window
from genolong.eval.store import PartialResults, write_atomic
from genolong.model import ops
from genolong.units import format_length

ROLES = ("baseline", "checkpoint")
# Part of the partial file's header: results scored another way (nats over the whole vocabulary,
# before this version) must not be mixed with these.
SCORING = "bits per base, probabilities renormalised over A, C, G, T; shuffled control seeded per block"


class Window(Protocol):
    tokens: np.ndarray
    repeat_mask: np.ndarray
    record: str
    start: int
    reverse: bool


@dataclass
class ModelSpec:
    """One model to score: where it comes from and what it is (for the compatibility check)."""

    source: str  # what the user typed
    label: str  # short name for the plot and the summary
    architecture: dict[str, Any]  # the model config; baseline and checkpoint must agree
    token_map: list[int]  # model token id of each DNA id; must agree too
    # model_dir (where it was found; provenance only) and fingerprint (its content: what a rerun must match)
    identity: dict[str, Any] = field(default_factory=dict)


@dataclass
class RankShare:
    """This process's share of the windows when eval-positional runs on dp ranks (`--parallel dp=N`
    under torchrun): window i of each model's to-do list is scored by dp rank i % world, the scores
    are gathered over the dp group, and global rank 0 alone appends to the partial file and writes
    the outputs. With cp > 1 every cp rank of a dp rank scores the same window, each its shard
    (genolong/eval/context_scorer.py); `group` is then this rank's dp group."""

    rank: int = 0
    world: int = 1
    group: Any = None  # the dp process group (None: the whole world)
    writer: bool | None = None  # global rank 0; None: dp rank 0 (no cp)

    @property
    def main(self) -> bool:
        return self.rank == 0 if self.writer is None else self.writer

    def gather(self, item: Any) -> list[Any]:
        if self.world == 1:
            return [item]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, item, group=self.group)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


@dataclass
class Settings:
    layout: Layout
    out_dir: Path
    max_windows: int | None = None
    max_n_fraction: float = 1.0
    n_boot: int = 1000
    seed: int = 0
    dtype: str = "float32"
    overwrite: bool = False
    progress: bool = True


def check_compatible(specs: dict[str, ModelSpec]) -> None:
    base, ck = specs["baseline"], specs["checkpoint"]
    if base.token_map != ck.token_map:
        raise GenolongError(
            f"--baseline {base.source} and --checkpoint {ck.source} use different vocabularies (DNA bases map to "
            f"token ids {base.token_map} vs {ck.token_map}): compare checkpoints of one model, e.g. a run's step 0 and its latest step"
        )
    diff = _first_diff(base.architecture, ck.architecture)
    if diff:
        what = "vocabularies" if diff.split(":")[0].split(".")[-1] == "vocab_size" else "architectures"
        raise GenolongError(
            f"--baseline {base.source} and --checkpoint {ck.source} have different {what} ({diff}): "
            "compare checkpoints of one model, e.g. a run's step 0 and its latest step"
        )


# Reported first when several fields differ: the ones a person recognises a model by.
_HEADLINE_FIELDS = ("vocab_size", "num_layers", "hidden")


def _first_diff(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b), key=lambda k: (k not in _HEADLINE_FIELDS, _HEADLINE_FIELDS.index(k) if k in _HEADLINE_FIELDS else 0, str(k)))
        for key in keys:
            d = _first_diff(a.get(key), b.get(key), f"{prefix}{key}.")
            if d:
                return d
        return None
    return None if a == b else f"{prefix.rstrip('.')}: {_short(a)} vs {_short(b)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def window_progress(enabled: bool) -> Progress:
    """The progress bar over scored windows (stderr; off when `enabled` is false)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("windows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        disable=not enabled,
    )


def evaluate(
    settings: Settings,
    specs: dict[str, ModelSpec],
    windows: Callable[[], Iterable[Window]],
    make_scorer: Callable[[str], ModelScorer],
    *,
    data_identity: dict[str, Any] | None = None,
    data_path: str | None = None,
    echo: Callable[[str], None] = print,
    markov: MarkovModel | Callable[[], MarkovModel] | None = None,
    note: Callable[[str], None] | None = None,
    share: RankShare | None = None,
) -> report.Results | None:
    """Score, aggregate, write. `windows()` restarts the tiling; `make_scorer(role)` loads a model;
    `markov` (a model, or a function fitting one, called once the partial file is accepted and
    before any model is scored) is scored beside the models as a yardstick; `note` gets progress
    messages (the CLI sends them to stderr); `share`: this rank's part of a data-parallel
    evaluation (RankShare; None: all windows here). Ranks other than 0 return None."""
    share = share or RankShare()
    layout = settings.layout
    check_compatible(specs)
    keys = [(w.record, int(w.start), bool(w.reverse)) for w in windows()]
    if not keys:
        raise GenolongError("the holdout split has no usable window: use a smaller --seq or a larger --max-n-fraction")

    # What the scores depend on. Not paths (a copied run or data directory resumes), not the
    # bootstrap (recomputed from the scores every time).
    fingerprint = {
        "scoring": SCORING,
        "seq": layout.seq,
        "bucket": layout.bucket,
        "control_context": layout.control,
        "controls": list(layout.controls),
        "controls_at": layout.controls_at,
        "max_n_fraction": settings.max_n_fraction,
        "dtype": settings.dtype,
        "data": data_identity or {},
        "models": {
            role: {"architecture": s.architecture, "token_map": s.token_map, "fingerprint": s.identity.get("fingerprint")}
            for role, s in specs.items()
        },
    }
    # Rank 0 creates (or cuts back) the partial file first; the others then read the same one.
    partial = PartialResults(settings.out_dir, fingerprint, overwrite=settings.overwrite) if share.main else None
    share.barrier()
    if partial is None:
        partial = PartialResults(settings.out_dir, fingerprint)
    if not share.main:
        note = None
    if note and layout.controls:
        # Each control costs whole extra passes: say how many before hours of GPU time go into them.
        cost = layout.forward_tokens()
        parts = ", ".join(f"{c} +{cost[c] / cost['full']:.2f}" for c in layout.controls)
        note(f"controls at C = {format_length(layout.control)}: {parts} full passes per window and model")
    if callable(markov) and share.main:
        markov = markov()

    with window_progress(settings.progress and share.main) as bar:
        for role in ROLES:
            todo = sum(not partial.done(role, k) for k in keys)
            if todo == 0:
                continue
            scorer = make_scorer(role)
            task = bar.add_task(f"{role} ({specs[role].label})", total=len(keys), completed=len(keys) - todo)
            pending = (w for w in _limit(windows(), len(keys)) if not partial.done(role, (w.record, int(w.start), bool(w.reverse))))
            # One window per rank at a time, read lazily: a window stream that fails part-way keeps what was scored.
            for group in _groups(pending, share.world):
                mine = group[share.rank] if share.rank < len(group) else None
                scored = None
                if mine is not None:
                    t0 = time.perf_counter()
                    score = score_window(scorer, mine.tokens, mine.repeat_mask, layout)
                    scored = ((mine.record, int(mine.start), bool(mine.reverse)), score, time.perf_counter() - t0)
                for item in share.gather(scored):
                    if item is not None and share.main:
                        partial.append(role, item[0], item[1], seconds=item[2])
                        bar.advance(task)
            del scorer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    if not share.main:
        return None
    scores = {role: [partial.get(role, k) for k in keys] for role in ROLES}
    if markov is not None:
        scores["markov"] = [
            reduce_window(markov.losses(w.tokens), {}, w.tokens, w.repeat_mask, layout) for w in _limit(windows(), len(keys))
        ]
    meta = {
        # Which implementation each hot op ran while scoring in this invocation (the original recipe's first lesson:
        # verify the kernels); empty when every window was already in the partial file.
        "kernels": ops.audit_summary(),
        "models": {role: {"source": s.source, "label": s.label, **s.identity} for role, s in specs.items()},
        "data": {"path": data_path, **(data_identity or {})},
        "max_n_fraction": settings.max_n_fraction,
        "dtype": settings.dtype,
        "seconds_per_window": _timing(partial, keys),
        "forward_tokens_per_window": layout.forward_tokens(),
        "markov": markov.info if markov is not None else None,
        "reach": _reach(_limit(windows(), len(keys)), layout),
        "n_boot": settings.n_boot,
        "seed": settings.seed,
    }
    res = report.aggregate(layout, keys, scores, n_boot=settings.n_boot, seed=settings.seed, meta=meta)
    write_outputs(res, settings.out_dir, labels={r: specs[r].label for r in ROLES})
    echo(report.summary_text(res).rstrip("\n"))
    return res


def _timing(partial: PartialResults, keys: list) -> dict[str, float | None]:
    """Mean wall seconds to score one window (full context + controls), per model; None if untimed."""
    out = {}
    for role in ROLES:
        times = [partial.seconds.get(role, {}).get(k) for k in keys]
        times = [t for t in times if t is not None]
        out[role] = sum(times) / len(times) if times else None
    return out


def _groups(it: Iterable[Window], size: int) -> Iterator[list[Window]]:
    group: list[Window] = []
    for w in it:
        group.append(w)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _limit(it: Iterable[Window], n: int) -> Iterator[Window]:
    for i, w in enumerate(it):
        if i >= n:
            return
        yield w


OUTPUT_FILES = ("positional.csv", "positional.json", "positional.png", "summary.txt")


REACH_K = 20


def _reach(windows: Iterable[Window], layout) -> dict[str, Any] | None:
    """genolong reach's count over the scored windows, at the control context: the share of late-bucket
    targets whose last REACH_K bases last occurred only beyond C (the long-range part's ceiling)."""
    from genolong.eval.reach import count_window, summarise

    if not layout.controls:
        return None
    rows = [count_window(w.tokens, w.repeat_mask, [REACH_K], layout.control, layout.bucket) for w in windows]
    if not rows:
        return None
    shares = summarise(rows, [REACH_K])["by_k"][str(REACH_K)]
    return {
        "k": REACH_K,
        "beyond": layout.control,
        "late_share": shares["far_share"][-1],
        "late_share_repeat": shares["far_share_repeat"][-1],
        "late_share_nonrepeat": shares["far_share_nonrepeat"][-1],
    }


def write_outputs(res: report.Results, out_dir: Path, *, labels: dict[str, str]) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "positional.csv", report.to_csv(res))
    write_atomic(out_dir / "positional.json", report.to_json(res))
    write_atomic(out_dir / "summary.txt", report.summary_text(res))
    plot_positional(res, out_dir / "positional.png", labels=labels)
