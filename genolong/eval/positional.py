"""Per-token held-out loss of one window, at full context and under context controls, bucketed by position.

A window of `seq` tokens is scored as next-token prediction: the model reads tokens [0, seq-1)
and predicts tokens [1, seq). The target at window position j has exactly j tokens of context,
so bucket b holds the targets j in [b * bucket, (b + 1) * bucket). Targets that are N are
masked (N is a real input token, but predicting it says nothing about DNA). The loss is in bits
with the model's probabilities renormalised over A, C, G, T (genolong.eval.dnaloss), so that 2
bits is uniform guessing for any vocabulary.

Two controls score the *same* targets with less real context, in blocks of C = `control`
targets ([C, 2C), [2C, 3C), ...); a target in a control block keeps between C and 2C - 1 tokens
of real context before it:
- **truncated**: the model runs on the C tokens before the block plus the block, so it sees
  only those tokens. Cost: about 2 tokens per target from 2C on, ~2x a full pass.
- **shuffled**: the model runs on the whole window up to the block's end, but with everything
  before the block's real context (tokens [0, s - C) for the block starting at s) replaced by a
  dinucleotide shuffle of itself (genolong.eval.shuffle). The model sees as many tokens as at full
  context, with the same composition and neighbour statistics, but no real distant order. Cost:
  one forward of s + C tokens per block, about seq / (2C) full passes.
A gain at full context that the truncated control lacks may only need "more tokens"; one that
the shuffled control lacks needs the real distant sequence. Targets j < 2C have no context beyond
their block's real context (the block [C, 2C) would be scored on tokens [0, 2C), the full
pass's own prefix), so their control losses are the full-context ones (no second run).

Only per-window, per-bucket sums and counts leave this module (split into non-repeat and
repeat targets): enough to bootstrap over windows and small enough to append to a partial file
after every window.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from genolong.errors import GenolongError
from genolong.eval.dnaloss import N_SCORED, auto_chunk_tokens, dna_token_loss
from genolong.eval.shuffle import dinucleotide_shuffle
from genolong.units import format_length
from genolong.vocab import N_ID

# Axis 0 of WindowScore.sums: every way a target can be scored; CONTROLS are the ones besides full.
MODES = ("full", "truncated", "shuffled")
CONTROLS = MODES[1:]
CONTROLS_AT = ("all", "late")
# Axis of target classes: soft-masked (lowercase in the FASTA) repeats vs the rest.
CLASSES = ("nonrepeat", "repeat")
LN2 = math.log(2.0)
# Mixed with a checksum of the window's tokens: the shuffled control is the same on every rerun.
SHUFFLE_SEED = 20261201

# (hidden [B,T,D], lm_head_weight [V,D], targets [B,T], chunk_tokens) -> loss fp32 [B,T]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """Window length, bucket width, control context C and the controls to run, validated together.

    `controls` is a subset of CONTROLS; it is empty when `control` is None.
    """

    seq: int
    bucket: int
    control: int | None
    controls: tuple[str, ...] = ("truncated",)
    # Which buckets the controls re-score: "all", or "late" (the last bucket only: the long-range
    # part of the late change needs no more, at ~1/n of the truncated control's cost and one full
    # pass instead of ~seq/2C for the shuffled one; the other buckets' control rows are NaN).
    controls_at: str = "all"

    def __post_init__(self) -> None:
        if self.bucket > self.seq:
            raise GenolongError(
                f"--bucket {format_length(self.bucket)} is larger than the window --seq {format_length(self.seq)}: "
                f"use a bucket of at most {format_length(self.seq)} (e.g. --bucket {format_length(max(1, self.seq // 16))})"
            )
        if self.seq < 2:
            raise GenolongError(f"--seq {self.seq} leaves no target to score: use at least 2 tokens")
        if self.controls_at not in CONTROLS_AT:
            raise GenolongError(
                f"--controls-at {self.controls_at!r} is not a choice: use all (every bucket) or late (the last bucket only)"
            )
        unknown = [c for c in self.controls if c not in CONTROLS]
        if unknown:
            raise GenolongError(
                f"--controls {','.join(self.controls)}: unknown control {unknown[0]!r}; "
                f"use truncated, shuffled, both ({','.join(CONTROLS)}) or none"
            )
        if self.control is None:
            object.__setattr__(self, "controls", ())
            return
        object.__setattr__(self, "controls", tuple(c for c in CONTROLS if c in self.controls))
        if 2 * self.control >= self.seq:
            # Controls re-score targets at least 2C into a window (blocks from 2C on): none exist then,
            # and a control equal to the full-context score would report a long-range part of exactly 0.
            raise GenolongError(
                f"--control-context {format_length(self.control)} leaves no target in a window of --seq "
                f"{format_length(self.seq)} with more than {format_length(2 * self.control)} bases before it, so the control "
                f"would equal the full-context score: use a --control-context below half the window (e.g. "
                f"{format_length(max(1, self.seq // 16))}) or --control-context 0 to skip it"
            )

    @property
    def n_buckets(self) -> int:
        return math.ceil(self.seq / self.bucket)

    @property
    def contexts(self) -> tuple[str, ...]:
        """The modes this layout scores: full, then the controls in MODES order."""
        return ("full",) + self.controls

    def bucket_edges(self) -> np.ndarray:
        """Target positions where buckets start, plus the end: [0, bucket, ..., seq]."""
        return np.minimum(np.arange(self.n_buckets + 1) * self.bucket, self.seq)

    def late_start(self) -> int:
        """First target position of the last bucket."""
        return (self.n_buckets - 1) * self.bucket

    def forward_tokens(self) -> dict[str, int]:
        """Tokens run through the model per window, per mode (the cost of each control)."""
        out = {"full": self.seq - 1}
        c = self.control
        if c:
            blocks = control_blocks(self)
            if "truncated" in self.controls:
                out["truncated"] = sum(end - (start - c) - 1 for start, end in blocks)
            if "shuffled" in self.controls:
                out["shuffled"] = sum(end - 1 for _, end in blocks)
        return out


@dataclass
class WindowScore:
    """Loss sums (bits, float64) and target counts of one window for one model.

    sums: [len(MODES), len(CLASSES), n_buckets]; counts: [len(CLASSES), n_buckets] (the same
    targets are scored in every mode). Rows of modes that were not run are NaN.
    """

    sums: np.ndarray
    counts: np.ndarray


class ModelScorer:
    """Runs one causal LM over token ids and returns per-target losses; no gradients ever.

    `model` needs `hidden_states(input_ids [B,T]) -> [B,T,D]` and `lm_head.weight [V,D]`;
    `token_map[dna_id]` gives the model's token id of each DNA base (identity for DNA-vocab
    models, the checkpoint's single-character ids for GLM checkpoints).

    Without `loss_fn` (the default, and what eval-positional uses) the loss is over A, C, G, T
    only (genolong.eval.dnaloss), from the four LM-head rows of `token_map[:4]`, and
    `chunk_tokens` defaults to ~256 MiB of fp32 hidden states. A `loss_fn` such as
    genolong.train.loss.chunked_token_loss gives the full-vocabulary loss instead.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        token_map: np.ndarray,
        loss_fn: LossFn | None = None,
        *,
        device: torch.device | str = "cpu",
        chunk_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.token_map = torch.as_tensor(np.asarray(token_map, dtype=np.int64))
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        hidden_size = model.lm_head.weight.shape[1]
        self.chunk_tokens = chunk_tokens or (auto_chunk_tokens(hidden_size) if loss_fn is None else 4096)
        self.scoring = "dna" if loss_fn is None else "full-vocabulary"

    def token_ids(self, tokens: np.ndarray) -> torch.Tensor:
        return self.token_map[torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))]

    @torch.inference_mode()
    def losses(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] (model token ids) -> fp32 loss in nats [B, T-1] of predicting ids[:, 1:]
        from the prefix before each; targets that are not A, C, G or T give 0 under DNA scoring."""
        ids = ids.to(self.device)
        return self.target_losses(ids[:, :-1], ids[:, 1:]).float().cpu()

    def target_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """inputs, targets [B, T] (model token ids, targets shifted by one) -> loss [B, T] on the device."""
        hidden = self.model.hidden_states(inputs)
        head = self.model.lm_head
        if self.loss_fn is not None:
            return self.loss_fn(hidden, head.weight, targets, self.chunk_tokens)
        base_ids = self.token_map[:N_SCORED].to(self.device)
        # Model token id -> DNA id 0-3 by comparison with the four base ids (no vocab-sized table).
        match = targets[..., None] == base_ids
        dna_targets = torch.where(match.any(-1), match.int().argmax(-1), -1)
        bias = head.bias[base_ids] if getattr(head, "bias", None) is not None else None
        return dna_token_loss(hidden, head.weight[base_ids], dna_targets, self.chunk_tokens, bias)


def shuffle_rng(tokens: np.ndarray, block_start: int) -> np.random.Generator:
    """The shuffled control's generator for one block of a window: seeded by the window's content and
    the block's start, so reruns agree and a block's shuffle does not depend on which blocks ran."""
    crc = zlib.crc32(np.ascontiguousarray(tokens, dtype=np.uint8).tobytes())
    return np.random.default_rng([SHUFFLE_SEED, crc, block_start])


def control_blocks(layout: Layout) -> list[tuple[int, int]]:
    """[start, end) of each control block whose control loss is computed: blocks of C from 2C on
    (targets before 2C have no context beyond their block's), in the last bucket only when
    controls_at is "late" (its blocks then start at the bucket's start)."""
    c = layout.control
    if not c:
        return []
    first = max(2 * c, layout.late_start()) if layout.controls_at == "late" else 2 * c
    return [(s, min(s + c, layout.seq)) for s in range(first, layout.seq, c)]


def score_window(scorer: ModelScorer, tokens: np.ndarray, repeat: np.ndarray, layout: Layout) -> WindowScore:
    """Full-context and control losses of one window, reduced to per-bucket sums and counts."""
    seq = len(tokens)
    if seq != layout.seq:
        raise ValueError(f"window has {seq} tokens, layout expects {layout.seq}")
    tokens = np.asarray(tokens)
    ids = scorer.token_ids(tokens)[None]
    full = scorer.losses(ids)[0].double().numpy()  # target j = index j - 1

    controls: dict[str, np.ndarray] = {}
    c = layout.control

    def start_from_full() -> np.ndarray:
        loss = full.copy()
        if layout.controls_at == "late":
            loss[: max(layout.late_start() - 1, 0)] = np.nan  # targets before the last bucket: not scored
        return loss

    if "truncated" in layout.controls:
        loss = start_from_full()
        for start, end in control_blocks(layout):
            chunk = scorer.losses(ids[:, start - c : end])[0].double().numpy()
            # chunk predicts targets (start - c + 1) .. (end - 1); keep those in [start, end)
            loss[start - 1 : end - 1] = chunk[c - 1 :]
        controls["truncated"] = loss
    if "shuffled" in layout.controls:
        loss = start_from_full()
        for start, end in control_blocks(layout):
            shuffled = dinucleotide_shuffle(tokens[: start - c], shuffle_rng(tokens, start))
            mixed = np.concatenate([shuffled, tokens[start - c : end]])
            chunk = scorer.losses(scorer.token_ids(mixed)[None])[0].double().numpy()
            loss[start - 1 : end - 1] = chunk[start - 1 : end - 1]
        controls["shuffled"] = loss
    return reduce_window(full, controls, tokens, repeat, layout)


def reduce_window(
    full: np.ndarray, controls: dict[str, np.ndarray], tokens: np.ndarray, repeat: np.ndarray, layout: Layout
) -> WindowScore:
    """Per-target losses in nats (index j-1 = target j), per mode -> per-(mode, class, bucket) sums
    in bits and counts. `controls` maps a control name to its per-target losses."""
    targets = np.asarray(tokens[1:])
    valid = targets != N_ID
    positions = np.arange(1, layout.seq)[valid]
    cls = np.asarray(repeat[1:], dtype=bool)[valid].astype(np.int64)
    cell = cls * layout.n_buckets + positions // layout.bucket  # flat (class, bucket) index
    size = len(CLASSES) * layout.n_buckets
    shape = (len(CLASSES), layout.n_buckets)
    counts = np.bincount(cell, minlength=size).reshape(shape).astype(np.int64)
    sums = np.full((len(MODES),) + shape, np.nan)
    for mode, loss in {"full": full, **controls}.items():
        bits = np.asarray(loss, dtype=np.float64)[valid] / LN2
        sums[MODES.index(mode)] = np.bincount(cell, weights=bits, minlength=size).reshape(shape)
    return WindowScore(sums=sums, counts=counts)
