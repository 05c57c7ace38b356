"""Per-token held-out loss of one window, at full context and with capped context, bucketed by position.

A window of `seq` tokens is scored as next-token prediction: the model reads tokens [0, seq-1)
and predicts tokens [1, seq). The target at window position j has exactly j tokens of context,
so bucket b holds the targets j in [b * bucket, (b + 1) * bucket). Targets that are N are
masked (N is a real input token, but predicting it says nothing about DNA).

The control scores the *same* targets with short context. Blocks of `control` tokens
([C, 2C), [2C, 3C), ...) are each scored by running the model on the C tokens before the block
plus the block itself and keeping the block's losses; a target in a control block therefore sees
between C and 2C - 1 tokens of context instead of up to seq - 1. Targets j < C already have
fewer than C tokens of context, and the block [C, 2C) would be scored on tokens [0, 2C), exactly
the full pass's prefix: so the control losses of targets j < 2C are the full-context ones (no
second run). Cost: about 2x a full-context pass, in chunks of 2C tokens. Any gain that the full-context
curve shows and the control curve lacks can only come from context further back than 2C.

Only per-window, per-bucket sums and counts leave this module (split into non-repeat and
repeat targets): enough to bootstrap over windows and small enough to append to a partial file
after every window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from genolong.errors import GenolongError
from genolong.units import format_length
from genolong.vocab import N_ID

# Axis 0 of WindowScore.sums: the two ways every target is scored.
MODES = ("full", "control")
# Axis of target classes: soft-masked (lowercase in the FASTA) repeats vs the rest.
CLASSES = ("nonrepeat", "repeat")

# (hidden [B,T,D], lm_head_weight [V,D], targets [B,T], chunk_tokens) -> loss fp32 [B,T]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """Window length, bucket width and control context, validated together."""

    seq: int
    bucket: int
    control: int | None

    def __post_init__(self) -> None:
        if self.bucket > self.seq:
            raise GenolongError(
                f"--bucket {format_length(self.bucket)} is larger than the window --seq {format_length(self.seq)}: "
                f"use a bucket of at most {format_length(self.seq)} (e.g. --bucket {format_length(max(1, self.seq // 16))})"
            )
        if self.seq < 2:
            raise GenolongError(f"--seq {self.seq} leaves no target to score: use at least 2 tokens")
        if self.control is not None and self.control >= self.seq:
            raise GenolongError(
                f"--control-context {format_length(self.control)} is not shorter than the window --seq "
                f"{format_length(self.seq)}, so the control would equal the full-context score: "
                f"use a smaller --control-context (e.g. {format_length(max(1, self.seq // 16))}) or --control-context 0 to skip it"
            )

    @property
    def n_buckets(self) -> int:
        return math.ceil(self.seq / self.bucket)

    def bucket_edges(self) -> np.ndarray:
        """Target positions where buckets start, plus the end: [0, bucket, ..., seq]."""
        return np.minimum(np.arange(self.n_buckets + 1) * self.bucket, self.seq)


@dataclass
class WindowScore:
    """Loss sums (nats, float64) and target counts of one window for one model.

    sums: [len(MODES), len(CLASSES), n_buckets]; counts: [len(CLASSES), n_buckets] (the same
    targets are scored in both modes). Without a control the control row is NaN.
    """

    sums: np.ndarray
    counts: np.ndarray


class ModelScorer:
    """Runs one causal LM over token ids and returns per-target losses; no gradients ever.

    `model` needs `hidden_states(input_ids [B,T]) -> [B,T,D]` and `lm_head.weight [V,D]`;
    `token_map[dna_id]` gives the model's token id of each DNA base (identity for DNA-vocab
    models, the checkpoint's single-character ids for GLM checkpoints).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        token_map: np.ndarray,
        loss_fn: LossFn,
        *,
        device: torch.device | str = "cpu",
        chunk_tokens: int = 4096,
    ) -> None:
        self.model = model
        self.token_map = torch.as_tensor(np.asarray(token_map, dtype=np.int64))
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.chunk_tokens = chunk_tokens

    def token_ids(self, tokens: np.ndarray) -> torch.Tensor:
        return self.token_map[torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))]

    @torch.inference_mode()
    def losses(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> fp32 loss [B, T-1] of predicting ids[:, 1:] from the prefix before each."""
        ids = ids.to(self.device)
        hidden = self.model.hidden_states(ids[:, :-1])
        loss = self.loss_fn(hidden, self.model.lm_head.weight, ids[:, 1:], self.chunk_tokens)
        return loss.float().cpu()


def score_window(scorer: ModelScorer, tokens: np.ndarray, repeat: np.ndarray, layout: Layout) -> WindowScore:
    """Full-context and control losses of one window, reduced to per-bucket sums and counts."""
    seq = len(tokens)
    if seq != layout.seq:
        raise ValueError(f"window has {seq} tokens, layout expects {layout.seq}")
    ids = scorer.token_ids(tokens)[None]
    full = scorer.losses(ids)[0].double().numpy()  # target j = index j - 1

    control = None
    if layout.control:
        c = layout.control
        # Targets j < 2C: the control chunk of block [C, 2C) would be tokens [0, 2C), the very
        # prefix the full pass saw, so their control losses are the full-context ones.
        control = full.copy()
        for start in range(2 * c, seq, c):
            end = min(start + c, seq)
            chunk = scorer.losses(ids[:, start - c : end])[0].double().numpy()
            # chunk predicts targets (start - c + 1) .. (end - 1); keep those in [start, end)
            control[start - 1 : end - 1] = chunk[c - 1 :]
    return reduce_window(full, control, tokens, repeat, layout)


def reduce_window(
    full: np.ndarray, control: np.ndarray | None, tokens: np.ndarray, repeat: np.ndarray, layout: Layout
) -> WindowScore:
    """Per-target losses (index j-1 = target j) -> per-(mode, class, bucket) sums and counts."""
    targets = np.asarray(tokens[1:])
    valid = targets != N_ID
    positions = np.arange(1, layout.seq)[valid]
    cls = np.asarray(repeat[1:], dtype=bool)[valid].astype(np.int64)
    cell = cls * layout.n_buckets + positions // layout.bucket  # flat (class, bucket) index
    size = len(CLASSES) * layout.n_buckets
    shape = (len(CLASSES), layout.n_buckets)
    counts = np.bincount(cell, minlength=size).reshape(shape).astype(np.int64)
    sums = np.full((len(MODES),) + shape, np.nan)
    sums[0] = np.bincount(cell, weights=full[valid], minlength=size).reshape(shape)
    if control is not None:
        sums[1] = np.bincount(cell, weights=control[valid], minlength=size).reshape(shape)
    return WindowScore(sums=sums, counts=counts)
