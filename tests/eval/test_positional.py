"""Window scoring: per-bucket sums equal a direct per-token computation, and each control is what it claims."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.eval.positional import CLASSES, MODES, Layout, ModelScorer, score_window, shuffle_rng
from genolong.eval.shuffle import dinucleotide_shuffle
from genolong.train.loss import chunked_token_loss
from genolong.vocab import N_ID
from tests.eval.standins import GRULM, make_windows, scorer

LN2 = math.log(2)


def direct_bits(model, ids, columns=(0, 1, 2, 3)):
    """Bits of each target (ids[1:]) from one plain forward with full logits: keep the four base
    columns, log-softmax over them, pick the target's column. N targets get NaN."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    with torch.no_grad():
        logits = model.lm_head(model.hidden_states(ids[:, :-1]))[0].double()
    logp = F.log_softmax(logits[:, list(columns)], dim=-1)
    out = np.full(ids.shape[1] - 1, np.nan)
    for j, t in enumerate(ids[0, 1:].tolist()):
        if t in columns:
            out[j] = -logp[j, list(columns).index(t)].item() / LN2
    return out


def bucket_sums(per_target, tokens, bucket, n_buckets):
    sums = np.zeros(n_buckets)
    for j in range(1, len(tokens)):
        if tokens[j] != N_ID:
            sums[j // bucket] += per_target[j - 1]
    return sums


def test_bucket_sums_match_a_direct_computation():
    model = GRULM(0)
    layout = Layout(seq=300, bucket=64, control=None)  # last bucket partial (256-300)
    for w in make_windows(3, 300):
        score = score_window(scorer(model, chunk_tokens=37), w.tokens, w.repeat_mask, layout)
        loss = direct_bits(model, w.tokens)
        for cls_index, cls in enumerate(CLASSES):
            for b in range(layout.n_buckets):
                picked = [
                    loss[j - 1]
                    for j in range(1, 300)
                    if j // 64 == b and w.tokens[j] != N_ID and bool(w.repeat_mask[j]) == (cls == "repeat")
                ]
                assert score.counts[cls_index, b] == len(picked)
                assert score.sums[0, cls_index, b] == pytest.approx(sum(picked), rel=1e-5, abs=1e-6)
        assert np.all(np.isnan(score.sums[1:]))  # no control asked for


def test_scores_are_renormalised_over_the_four_bases_of_any_vocabulary():
    """A GLM-style model: 16 tokens, bases at ids 11-15, text tokens that take probability mass."""
    model = GRULM(2, vocab=16)
    token_map = [11, 12, 13, 14, 15]
    w = make_windows(2, 200)[1]  # has an N run
    layout = Layout(seq=200, bucket=50, control=None)
    score = score_window(scorer(model, token_map=token_map), w.tokens, w.repeat_mask, layout)
    ids = np.asarray(token_map)[w.tokens]
    expect = bucket_sums(direct_bits(model, ids, columns=(11, 12, 13, 14)), w.tokens, 50, 4)
    np.testing.assert_allclose(score.sums[0].sum(axis=0), expect, rtol=1e-5)
    # Renormalising over a subset that holds the target can only raise its probability: the
    # DNA-only loss is below the full-vocabulary loss of the same model at every target.
    full_vocab = ModelScorer(model, np.asarray(token_map), chunked_token_loss, chunk_tokens=64)
    whole = full_vocab.losses(full_vocab.token_ids(w.tokens)[None])[0].double().numpy() / LN2
    dna = direct_bits(model, ids, columns=(11, 12, 13, 14))
    valid = w.tokens[1:] != N_ID
    assert np.all(dna[valid] <= whole[valid] + 1e-9) and np.mean(whole[valid] - dna[valid]) > 0.1


def test_n_targets_are_not_counted():
    w = make_windows(2, 256)[1]  # window 1 has an N run
    score = score_window(scorer(GRULM(0)), w.tokens, w.repeat_mask, Layout(256, 32, None))
    assert score.counts.sum() == int((w.tokens[1:] != N_ID).sum()) < 255


def test_truncated_control_scores_each_target_with_capped_context():
    model = GRULM(1)
    seq, c = 200, 48
    w = make_windows(1, seq, seed=3, n_run=False)[0]
    layout = Layout(seq=seq, bucket=seq // 4, control=c, controls=("truncated",))
    score = score_window(scorer(model), w.tokens, w.repeat_mask, layout)
    full = direct_bits(model, w.tokens)

    # Independently: target j in block [s, s+c) is predicted from tokens[s-c : j] only.
    control = full.copy()
    for j in range(2 * c, seq):
        s = (j // c) * c
        control[j - 1] = direct_bits(model, w.tokens[s - c : j + 1])[-1]
    assert not np.allclose(control, full)  # the stand-in really depends on far context

    truncated = MODES.index("truncated")
    for b in range(layout.n_buckets):
        in_b = np.arange(1, seq) // layout.bucket == b
        assert score.sums[truncated, :, b].sum() == pytest.approx(control[in_b].sum(), rel=1e-5)
        assert score.sums[0, :, b].sum() == pytest.approx(full[in_b].sum(), rel=1e-5)
    assert np.all(np.isnan(score.sums[MODES.index("shuffled")]))


def dinucleotides(a):
    a = np.asarray(a, dtype=np.int64)
    return np.bincount(a[:-1] * 5 + a[1:], minlength=25)


def test_shuffled_control_changes_only_the_context_beyond_c():
    model = GRULM(1)
    seq, c = 256, 48
    w = make_windows(1, seq, seed=4, n_run=False)[0]
    w.tokens[20:30] = N_ID  # an N run in the shuffled part: shuffled along with the rest
    layout = Layout(seq=seq, bucket=64, control=c, controls=("shuffled",))
    score = score_window(scorer(model), w.tokens, w.repeat_mask, layout)

    runs = model.inputs[1:]  # after the full pass: one run per control block, in order
    starts = list(range(2 * c, seq, c))
    assert len(runs) == len(starts)
    control = direct_bits(model, w.tokens)
    for s, run in zip(starts, runs):
        end = min(s + c, seq)
        ids = run[0].numpy()
        assert len(ids) == end - 1  # the model sees as many tokens as at full context
        np.testing.assert_array_equal(ids[s - c :], w.tokens[s - c : end - 1])  # real context C..2C-1, untouched
        prefix, real = ids[: s - c], w.tokens[: s - c]
        assert not np.array_equal(prefix, real)  # shuffled ...
        assert np.array_equal(dinucleotides(prefix), dinucleotides(real))  # ... keeping every neighbour pair
        assert prefix[0] == real[0]
        # The block's targets, scored directly from that very input.
        mixed = np.concatenate([prefix, w.tokens[s - c : end]])
        control[s - 1 : end - 1] = direct_bits(model, mixed)[s - 1 : end - 1]

    shuffled = MODES.index("shuffled")
    full = direct_bits(model, w.tokens)
    valid = w.tokens[1:] != N_ID
    for b in range(layout.n_buckets):
        in_b = (np.arange(1, seq) // 64 == b) & valid
        assert score.sums[shuffled, :, b].sum() == pytest.approx(control[in_b].sum(), rel=1e-5)
    # Targets before 2C have nothing beyond their real context: control == full there.
    assert score.sums[shuffled, :, 0].sum() == pytest.approx(full[(np.arange(1, seq) < 64) & valid].sum(), rel=1e-6)
    assert not np.isclose(score.sums[shuffled, :, 3].sum(), score.sums[0, :, 3].sum())

    # The same window gives the same shuffle on a rerun (seeded by its content).
    again = score_window(scorer(model), w.tokens, w.repeat_mask, layout)
    np.testing.assert_array_equal(again.sums, score.sums)


def test_control_runs_and_their_lengths():
    model = GRULM(0)
    seq, c = 256, 64
    w = make_windows(1, seq)[0]
    layout = Layout(seq, 64, c, controls=("truncated", "shuffled"))
    score_window(scorer(model), w.tokens, w.repeat_mask, layout)
    blocks = math.ceil((seq - 2 * c) / c)  # [C, 2C) is the full pass's own prefix
    assert model.calls == 1 + 2 * blocks
    lengths = [x.shape[1] for x in model.inputs]
    assert sum(lengths) == sum(layout.forward_tokens().values())


@pytest.mark.parametrize(
    ("seq", "bucket", "control", "controls", "flag"),
    [
        (1024, 2048, None, (), "--bucket"),
        (1024, 64, 1024, ("truncated",), "--control-context"),
        (1024, 64, 512, ("truncated",), "--control-context"),  # no target is 2C into the window: nothing to re-score
        (1, 1, None, (), "--seq"),
        (1024, 64, 64, ("reversed",), "--controls"),
    ],
)
def test_layout_refuses_impossible_settings(seq, bucket, control, controls, flag):
    with pytest.raises(GenolongError, match=flag) as err:
        Layout(seq=seq, bucket=bucket, control=control, controls=controls)
    assert "\n" not in str(err.value)


def test_layout_without_control_context_runs_no_control():
    assert Layout(512, 64, None, controls=("truncated", "shuffled")).contexts == ("full",)
    assert Layout(512, 64, 64, controls=("shuffled", "truncated")).contexts == ("full", "truncated", "shuffled")


def test_late_controls_rescore_the_last_bucket_only():
    """--controls-at late: the last bucket's control sums are exactly the ones every-bucket controls
    give (same blocks when the bucket is a multiple of C), the shuffled one equals a direct
    computation on its shuffled input, the other buckets' control rows are NaN, and the model runs
    only on the last bucket's blocks."""
    seq, bucket, c = 256, 64, 32
    w = make_windows(1, seq, seed=5, n_run=False)[0]
    every = score_window(scorer(GRULM(1)), w.tokens, w.repeat_mask, Layout(seq, bucket, c, ("truncated",)))
    model = GRULM(1)
    layout = Layout(seq, bucket, c, ("truncated", "shuffled"), controls_at="late")
    late = score_window(scorer(model), w.tokens, w.repeat_mask, layout)
    lengths = [x.shape[1] for x in model.inputs]

    truncated, shuffled = MODES.index("truncated"), MODES.index("shuffled")
    np.testing.assert_allclose(late.sums[truncated, :, 3], every.sums[truncated, :, 3], rtol=1e-6)
    np.testing.assert_allclose(late.sums[0], every.sums[0], rtol=1e-6)
    assert not np.allclose(late.sums[truncated, :, 3], late.sums[0, :, 3])  # the control did cut something
    assert np.all(np.isnan(late.sums[[truncated, shuffled], :, :3]))

    # Shuffled: blocks [192, 224) and [224, 256), each from its own generator (window content, block start).
    expected = 0.0
    for s in (192, 224):
        mixed = np.concatenate([dinucleotide_shuffle(w.tokens[: s - c], shuffle_rng(w.tokens, s)), w.tokens[s - c : s + c]])
        expected += direct_bits(model, mixed)[s - 1 : s + c - 1].sum()
    assert late.sums[shuffled, :, 3].sum() == pytest.approx(expected, rel=1e-5)

    # Runs: the full pass, 2 truncated blocks of 2C tokens less one, 2 shuffled runs to each block's end.
    assert lengths == [seq - 1, 2 * c - 1, 2 * c - 1, 223, 255]
    assert layout.forward_tokens() == {"full": seq - 1, "truncated": 2 * (2 * c - 1), "shuffled": 223 + 255}


def test_late_controls_off_the_c_grid_and_in_a_single_bucket():
    """The last bucket's blocks start at the bucket (here not on the C grid): target j in [100, 128)
    reads tokens [68, j) only. A single bucket: its targets before 2C keep the full-context loss (no
    context beyond their real one), as with every-bucket controls."""
    seq, c = 128, 32
    w = make_windows(1, seq, seed=6, n_run=False)[0]
    layout = Layout(seq, 100, c, ("truncated",), controls_at="late")  # buckets [0, 100), [100, 128)
    late = score_window(scorer(GRULM(1)), w.tokens, w.repeat_mask, layout)
    truncated = MODES.index("truncated")
    assert np.all(np.isnan(late.sums[truncated, :, 0]))
    expected = sum(direct_bits(GRULM(1), w.tokens[100 - c : j + 1])[-1] for j in range(100, seq))
    assert late.sums[truncated, :, 1].sum() == pytest.approx(expected, rel=1e-5)
    one_bucket = Layout(seq, seq, c, ("truncated",), controls_at="late")
    whole = score_window(scorer(GRULM(1)), w.tokens, w.repeat_mask, one_bucket)
    assert not np.any(np.isnan(whole.sums[truncated]))


def test_layout_refuses_an_unknown_controls_at():
    with pytest.raises(GenolongError, match="--controls-at") as err:
        Layout(256, 64, 32, ("truncated",), controls_at="last")
    assert "\n" not in str(err.value)
