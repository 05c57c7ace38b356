"""The k-mer Markov baseline: counts, scores and the order choice against plain dictionary computations."""

import math
from collections import defaultdict

import numpy as np
import pytest

from genolong.data import prepare
from genolong.errors import GenolongError
from genolong.eval import markov
from genolong.vocab import N_ID


def naive_counts(seqs, max_order):
    """{k: {context string: [n_A, n_C, n_G, n_T]}}: every target whose k bases before it (in the
    same sequence) and itself are A/C/G/T."""
    out = {k: defaultdict(lambda: [0, 0, 0, 0]) for k in range(max_order + 1)}
    for seq in seqs:
        seq = [int(v) for v in seq]
        for i, b in enumerate(seq):
            for k in range(max_order + 1):
                ctx = seq[i - k : i] if k else []
                if b < 4 and i >= k and all(v < 4 for v in ctx):
                    out[k]["".join(map(str, ctx))][b] += 1
    return out


def as_tables(naive, max_order):
    tables = []
    for k in range(max_order + 1):
        t = np.zeros((4**k, 4), dtype=np.int64)
        for ctx, row in naive[k].items():
            t[int(ctx, 4) if ctx else 0] = row  # base-4 digits, oldest first
        tables.append(t)
    return tables


def sequences(seed, lengths, n_runs=True):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        s = rng.choice(4, size=n, p=[0.35, 0.15, 0.2, 0.3]).astype(np.uint8)
        if n_runs and n > 60:
            s[20:23] = N_ID
            s[50] = N_ID
        out.append(s)
    return out


@pytest.mark.parametrize("block", [7, 1 << 23])
def test_counts_equal_a_dictionary_count(monkeypatch, block):
    monkeypatch.setattr(markov, "_BLOCK", block)  # small blocks: contexts across block edges
    seqs = sequences(0, [300, 5, 180])
    got = markov.count_contexts(seqs, 4)
    expect = as_tables(naive_counts(seqs, 4), 4)
    for k in range(5):
        np.testing.assert_array_equal(got[k], expect[k], err_msg=f"order {k}")


def test_window_losses_back_off_at_the_start_and_after_n():
    train = sequences(1, [2000, 700])
    model = markov.MarkovModel(markov.count_contexts(train, 3), alpha=0.5)
    naive = naive_counts(train, 3)
    window = sequences(2, [120])[0]
    got = model.losses(window)
    assert got.shape == (119,)
    w = [int(v) for v in window]
    for j in range(1, len(w)):
        if w[j] >= 4:
            assert got[j - 1] == 0
            continue
        run = 0
        while run < 3 and j - run - 1 >= 0 and w[j - run - 1] < 4:
            run += 1
        row = naive[run]["".join(map(str, w[j - run : j]))]
        p = (row[w[j]] + 0.5) / (sum(row) + 2.0)
        assert got[j - 1] == pytest.approx(-math.log(p), rel=1e-12), j


def test_validation_bits_equal_a_direct_mean():
    train, val = sequences(3, [3000]), sequences(4, [400])
    counts = markov.count_contexts(train, 3)
    table, n = markov.validation_bits(counts, val, (0.1, 1.0))
    naive = naive_counts(train, 3)
    v = [int(x) for x in val[0]]
    targets = [j for j in range(3, len(v)) if all(x < 4 for x in v[j - 3 : j + 1])]
    assert n == len(targets)
    for k in range(4):
        for a_i, a in enumerate((0.1, 1.0)):
            bits = []
            for j in targets:
                row = naive[k]["".join(map(str, v[j - k : j]))]
                bits.append(-math.log2((row[v[j]] + a) / (sum(row) + 4 * a)))
            assert table[k, a_i] == pytest.approx(np.mean(bits), rel=1e-10)


def order2_chain(rng, n):
    probs = rng.dirichlet([0.4] * 4, size=16)
    out = np.zeros(n, dtype=np.uint8)
    out[:2] = rng.integers(0, 4, 2)
    u = rng.random(n)
    cum = probs.cumsum(axis=1)
    for i in range(2, n):
        out[i] = np.searchsorted(cum[out[i - 2] * 4 + out[i - 1]], u[i])
    return np.minimum(out, 3)


def test_the_order_of_a_markov_chain_is_found_on_validation():
    rng = np.random.default_rng(5)
    chain = order2_chain(rng, 240_000)
    model = markov.fit([chain[:200_000]], [chain[200_000:]], max_order=6)
    assert model.order == 2
    assert model.info["max_order"] == 6
    bits = np.array(model.info["validation_bits"])
    assert bits[2].min() < bits[1].min() - 0.05  # far better than order 1 on this chain
    assert bits[2].min() < 1.9  # and than uniform
    assert len(model.counts) == 3


def test_the_held_out_slice_is_added_back():
    train = sequences(6, [500, 300])
    slices = sequences(7, [60, 40])
    model = markov.fit(train, slices, max_order=2, alphas=(0.5,), add_back=[(s, 0) for s in slices])
    expect = as_tables(naive_counts(train + slices, model.order), model.order)
    for k in range(model.order + 1):
        np.testing.assert_array_equal(model.counts[k], expect[k])


def test_the_added_back_slice_keeps_its_context_across_the_cut():
    # Whole records cut into a train part and a held-out slice: counted back with the bases before
    # the cut as context, the tables equal those of the uncut records (no target counted twice, none
    # of the slice's first targets demoted to a lower order).
    whole = sequences(8, [700, 450])
    cuts = [600, 400]
    train = [r[:c] for r, c in zip(whole, cuts)]
    held = [r[c:] for r, c in zip(whole, cuts)]
    add_back = [(r[c - 3 :], 3) for r, c in zip(whole, cuts)]  # three bases of look-back: orders up to 3
    model = markov.fit(train, held, max_order=3, alphas=(0.5,), add_back=add_back)
    expect = as_tables(naive_counts(whole, model.order), model.order)
    for k in range(model.order + 1):
        np.testing.assert_array_equal(model.counts[k], expect[k])


def test_order_cap_by_train_size_and_memory():
    assert markov.order_cap(12, 30_000_000) == 12
    assert markov.order_cap(12, 5_000_000) == 11  # 4^12 = 16.8M contexts > 5M bases
    assert markov.order_cap(20, 10**12) == 12  # order 13: 4^13 x 4 x 8 bytes = 2 GiB > 1 GiB
    assert markov.order_cap(3, 10) == 1


def _fasta(path):
    rng = np.random.default_rng(8)

    def rec(name, n):
        s = "".join(rng.choice(list("ACGTacgt"), n))
        return f">{name}\n" + "\n".join(s[i : i + 60] for i in range(0, n, 60)) + "\n"

    path.write_text(rec("chr1", 8000) + rec("chr2", 3000) + rec("chr3", 2000))


@pytest.mark.parametrize("validation", [None, "chr2"])
def test_fit_or_load_caches_and_says_where_it_chose(tmp_path, monkeypatch, validation):
    _fasta(tmp_path / "g.fa")
    data = tmp_path / "data"
    prepare(tmp_path / "g.fa", data, train="chr1", holdout="chr3", validation=validation, progress=False, log=lambda _: None)
    from genolong.data import open_prepared

    pg = open_prepared(data)
    said = []
    model = markov.fit_or_load(pg, tmp_path / "eval", max_order=4, echo=said.append)
    assert (tmp_path / "eval" / markov.CACHE_NAME).is_file()
    if validation:
        assert model.info["validation"] == "the validation split (chr2)"
        tokens = pg.read("train", "chr1", 0, 8000)[0]
        expect = as_tables(naive_counts([tokens], model.order), model.order)
    else:
        assert "last 10% of each train record" in model.info["validation"]
        tokens = pg.read("train", "chr1", 0, 8000)[0]
        expect = as_tables(naive_counts([tokens[:7200], tokens[7200:]], model.order), model.order)
    for k in range(model.order + 1):
        np.testing.assert_array_equal(model.counts[k], expect[k])
    assert any("Markov baseline: order" in line for line in said)

    # The rerun loads the cache; other settings refit.
    monkeypatch.setattr(markov, "fit", lambda *a, **k: pytest.fail("refitted although cached"))
    again = markov.fit_or_load(pg, tmp_path / "eval", max_order=4, echo=said.append)
    assert again.order == model.order and again.alpha == model.alpha
    for a, b in zip(again.counts, model.counts):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(pytest.fail.Exception, match="refitted"):
        markov.fit_or_load(pg, tmp_path / "eval", max_order=3, echo=said.append)


def test_no_train_bases_is_refused():
    with pytest.raises(GenolongError, match="no A/C/G/T base"):
        markov.fit([np.full(100, N_ID, dtype=np.uint8)], [np.zeros(10, dtype=np.uint8)])
