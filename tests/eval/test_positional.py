"""Window scoring: per-bucket sums equal a direct per-token computation, and the control is what it claims."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.eval.positional import CLASSES, Layout, score_window
from genolong.vocab import N_ID
from tests.eval.standins import GRULM, make_windows, scorer


def direct_losses(model, tokens):
    """Loss of target j (j = 1..T-1) from one plain forward and F.cross_entropy: no chunking."""
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        logits = model.lm_head(model.hidden_states(ids[:, :-1]))[0]
    return F.cross_entropy(logits.double(), ids[0, 1:], reduction="none").numpy()


def test_bucket_sums_match_a_direct_computation():
    model = GRULM(0)
    layout = Layout(seq=300, bucket=64, control=None)  # last bucket partial (256-300)
    for w in make_windows(3, 300):
        score = score_window(scorer(model, chunk_tokens=37), w.tokens, w.repeat_mask, layout)
        loss = direct_losses(model, w.tokens)
        for cls_index, cls in enumerate(CLASSES):
            for b in range(layout.n_buckets):
                picked = [
                    loss[j - 1]
                    for j in range(1, 300)
                    if j // 64 == b and w.tokens[j] != N_ID and bool(w.repeat_mask[j]) == (cls == "repeat")
                ]
                assert score.counts[cls_index, b] == len(picked)
                assert score.sums[0, cls_index, b] == pytest.approx(sum(picked), rel=1e-5, abs=1e-6)
        assert np.all(np.isnan(score.sums[1]))  # no control asked for


def test_n_targets_are_not_counted():
    w = make_windows(2, 256)[1]  # window 1 has an N run
    score = score_window(scorer(GRULM(0)), w.tokens, w.repeat_mask, Layout(256, 32, None))
    assert score.counts.sum() == int((w.tokens[1:] != N_ID).sum()) < 255


def test_control_scores_each_target_with_capped_context():
    model = GRULM(1)
    seq, c = 200, 48
    w = make_windows(1, seq, seed=3, n_run=False)[0]
    layout = Layout(seq=seq, bucket=seq // 4, control=c)
    score = score_window(scorer(model), w.tokens, w.repeat_mask, layout)
    full = direct_losses(model, w.tokens)

    # Independently: target j in block [s, s+c) is predicted from tokens[s-c : j] only.
    control = full.copy()
    for j in range(c, seq):
        s = (j // c) * c
        ctx = torch.from_numpy(w.tokens[s - c : j].astype(np.int64))[None]
        with torch.no_grad():
            logits = model.lm_head(model.hidden_states(ctx))[0, -1]
        control[j - 1] = F.cross_entropy(logits.double()[None], torch.tensor([int(w.tokens[j])])).item()
    assert not np.allclose(control, full)  # the stand-in really depends on far context

    valid = w.tokens[1:] != N_ID
    for b in range(layout.n_buckets):
        in_b = (np.arange(1, seq) // layout.bucket == b) & valid
        got = score.sums[1, :, b].sum()
        assert got == pytest.approx(control[in_b].sum(), rel=1e-5)
        assert score.sums[0, :, b].sum() == pytest.approx(full[in_b].sum(), rel=1e-5)


def test_control_runs_chunks_of_two_c():
    model = GRULM(0)
    seq, c = 256, 64
    w = make_windows(1, seq)[0]
    score_window(scorer(model), w.tokens, w.repeat_mask, Layout(seq, 64, c))
    # one full pass + one per control block from 2C on ([C, 2C) is the full pass's own prefix)
    assert model.calls == 1 + math.ceil((seq - 2 * c) / c)


@pytest.mark.parametrize(
    ("seq", "bucket", "control", "flag"),
    [(1024, 2048, None, "--bucket"), (1024, 64, 1024, "--control-context"), (1, 1, None, "--seq")],
)
def test_layout_refuses_impossible_settings(seq, bucket, control, flag):
    with pytest.raises(GenolongError, match=flag) as err:
        Layout(seq=seq, bucket=bucket, control=control)
    assert "\n" not in str(err.value)
