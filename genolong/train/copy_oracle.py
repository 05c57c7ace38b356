"""The copy curriculum's selection oracle (`finetune --copy-oracle K`), applied from outside the model.

Why: the DSA layers are NoPE; a model trained from scratch forms content-matching ("copying")
attention very slowly, because with thousands of keys in view the one worth copying from is
rarely where the gradient can find it, and an untrained indexer selects it by chance only. With
few keys in view and the right one among them, the same layers learn to copy within a few
hundred steps (docs/recall.md). The oracle does exactly that for every query whose last K bases
occurred earlier in the window (natural repeats and planted copies alike): the pool holding the
base that followed their most recent earlier occurrence (genolong.data.kmers) is put into the
query's selection, in place of its weakest selected pool, unless the indexer already selected it
or it is the query's own tail pool. Queries without a match keep the indexer's selection.

The oracle is derived from the input tokens only, causally (the needed key is at or before the
query), and it is a training aid: evaluation and later stages run the model's own indexer, whose
KL against the main attention (--indexer-loss-coeff) teaches it to find what the oracle gave.

It is set on every DSA layer that owns an indexer for a micro-batch's forward *and* backward, so a
layer recomputed in the backward (full-layer recompute) selects exactly what its forward did.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from genolong.data.kmers import previous_occurrence


def oracle_keys(inputs: np.ndarray, k: int) -> np.ndarray:
    """int64 [B, T]: for query t of each row of DNA-id inputs [B, T], the key position to copy from
    (the base after the most recent earlier occurrence of the k bases ending at t), or -1."""
    out = np.full(inputs.shape, -1, dtype=np.int64)
    for row, tokens in enumerate(inputs):
        prev = previous_occurrence(tokens, k)
        has = prev >= 0
        out[row, has] = prev[has] + 1
    return out


def oracle_layers(model) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", model), "layers", [])
    return [layer.self_attn for layer in layers if getattr(layer.self_attn, "indexer", None) is not None]


@contextlib.contextmanager
def selection_oracle(model, keys: torch.Tensor | None):
    """Within the block, every DSA layer with an indexer adds the oracle pools of `keys` [B, T] to its
    selection (None: nothing changes). Wrap a micro-batch's forward and backward."""
    layers = oracle_layers(model) if keys is not None else []
    for layer in layers:
        layer.selection_oracle = keys
    try:
        yield
    finally:
        for layer in layers:
            layer.selection_oracle = None
