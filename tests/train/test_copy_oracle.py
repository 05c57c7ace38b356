"""The copy curriculum: k-mer matches, the selection oracle, the dense warm-up's main path, and
the finetune options that carry them (--copy-oracle, --indexer-topk, --layers)."""

import numpy as np
import pytest
import torch

from genolong.data.kmers import kmer_codes, previous_occurrence, reach_mask
from genolong.errors import GenolongError
from genolong.model import get_preset
from genolong.model.dsa import add_oracle_pools, dense_causal_attention, sparse_attention_reference
from genolong.model.indexer import indexer_topk_reference
from genolong.model.presets import set_indexer_topk, with_indexer_topk
from genolong.train import loop
from genolong.train.copy_oracle import oracle_keys, selection_oracle
from genolong.train.metrics import read_jsonl
from genolong.train import checkpoint as ck
from genolong.vocab import N_ID
from tests.train._helpers import tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")


def _brute_previous(tokens, k):
    out = []
    for i in range(len(tokens)):
        found = -1
        if i >= k - 1 and N_ID not in tokens[i - k + 1 : i + 1]:
            for j in range(i - 1, k - 2, -1):
                if list(tokens[j - k + 1 : j + 1]) == list(tokens[i - k + 1 : i + 1]):
                    found = j
                    break
        out.append(found)
    return np.array(out)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_previous_occurrence_equals_a_brute_force_search(k):
    rng = np.random.default_rng(k)
    tokens = rng.integers(0, 4, size=400)
    tokens[rng.integers(0, 400, size=12)] = N_ID  # N breaks k-mers
    tokens[200:230] = tokens[40:70]  # a planted repeat
    np.testing.assert_array_equal(previous_occurrence(tokens, k), _brute_previous(tokens, k))


def test_kmer_codes_mark_windows_with_n_or_too_short_invalid():
    tokens = np.array([0, 1, 2, N_ID, 3, 0, 1, 2])
    codes, valid = kmer_codes(tokens, 3)
    assert valid.tolist() == [False, False, True, False, False, False, True, True]
    # ACG and ...: the k-mer ending at 7 is (0, 1, 2) again, i.e. the one ending at 2.
    assert codes[7] == codes[2]
    with pytest.raises(GenolongError, match="k-mer length"):
        kmer_codes(tokens, 32)


def test_reach_mask_counts_only_matches_beyond_the_distance():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=3000)
    tokens[2500:2600] = tokens[100:200]  # copied 2400 back
    tokens[1300:1340] = tokens[1200:1240]  # copied 100 back
    far = reach_mask(tokens, 16, beyond=1000)
    near = reach_mask(tokens, 16, beyond=50)
    # Target j is predictable from a match once the 16 bases before it are inside the copy.
    assert far[2500 + 16 - 1 : 2600 - 1].all() and far[1300 + 16 - 1 : 1340 - 1].sum() == 0
    assert near[1300 + 16 - 1 : 1340 - 1].all()
    assert far.sum() < 120  # random 16-mers do not recur by chance in 3 kb


def test_oracle_keys_point_at_the_base_after_the_earlier_occurrence():
    rng = np.random.default_rng(1)
    row = rng.integers(0, 4, size=500)
    row[300:360] = row[100:160]
    keys = oracle_keys(row[None], 12)[0]
    for t in range(300 + 11, 359):
        assert keys[t] == t - 200 + 1 and row[keys[t]] == row[t + 1]
    assert (keys[:111] == -1).all()


def _selection(seq=64, topk=8, kpool=4, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(1, seq, 2, 8)
    keys = torch.randn(1, seq // kpool, 8)
    weights = torch.rand(1, seq, 2)
    return indexer_topk_reference(q, keys, weights, kpool=kpool, topk_pools=topk // kpool, always_select_tail=True, softmax_scale=1.0)


def test_oracle_pool_replaces_the_weakest_pool_and_only_where_needed():
    topk = _selection()
    keys = torch.full((1, 64), -1, dtype=torch.long)
    keys[0, 50] = 9  # pool 2 (keys 8-11)
    keys[0, 54] = 53  # inside query 54's incomplete tail pool (52-54): already visible
    present = int(topk[0, 52, 0])  # a key query 52 already selected
    keys[0, 52] = present
    out = add_oracle_pools(topk, keys, kpool=4, topk_pools=2)
    assert 9 not in topk[0, 50].tolist()  # (seeded) the indexer did not select it: the oracle must
    assert out[0, 50, 4:8].tolist() == [8, 9, 10, 11] and torch.equal(out[0, 50, :4], topk[0, 50, :4])
    assert torch.equal(out[0, 54], topk[0, 54]) and torch.equal(out[0, 52], topk[0, 52])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[50] = False
    assert torch.equal(out[0, untouched], topk[0, untouched])
    # No key is ever listed twice (a duplicate would count twice in the attention).
    for row in out[0]:
        listed = [v for v in row.tolist() if v >= 0]
        assert len(listed) == len(set(listed))


def test_dense_causal_attention_equals_the_reference_over_every_earlier_key():
    torch.manual_seed(0)
    q, kv = torch.randn(2, 37, 3, 16), torch.randn(2, 37, 16)
    every = torch.arange(37)
    indices = torch.where(every[None, :] <= every[:, None], every[None, :], -1).to(torch.int32).expand(2, 37, 37)
    want = sparse_attention_reference(q, kv, indices, scale=0.25)
    torch.testing.assert_close(dense_causal_attention(q, kv, scale=0.25), want, rtol=1e-5, atol=1e-6)
    # A piece of the queries (context parallelism) against the whole sequence's keys.
    torch.testing.assert_close(dense_causal_attention(q[:, 20:], kv, scale=0.25, query_offset=20), want[:, 20:], rtol=1e-5, atol=1e-6)


def test_indexer_topk_override_keeps_the_weights_and_is_validated():
    config = get_preset("tiny")
    assert with_indexer_topk(config, None) is config
    assert with_indexer_topk(config, 8).dsa.indexer.topk == 8
    with pytest.raises(GenolongError, match="multiple of the indexer's pool size"):
        with_indexer_topk(config, 6)
    from genolong.model import GenoLongForCausalLM

    model = GenoLongForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    set_indexer_topk(model, 8)
    assert model.config.dsa.indexer.topk == 8 and model.model.layers[3].self_attn.indexer.cfg.topk_pools == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_oracle_changes_the_selection_in_the_forward_and_the_recomputed_backward():
    """With the oracle, the DSA layer sees the copy's source: the loss differs from a run without it, and
    under full-layer recompute (the backward re-runs the forward) the gradients equal those of the
    same step without recompute, so the recomputed forward selected what the first one did."""
    from genolong.model import GenoLongForCausalLM
    from genolong.train.recompute import apply_recompute

    torch.manual_seed(0)
    model = GenoLongForCausalLM(with_indexer_topk(get_preset("tiny"), 8))
    rng = np.random.default_rng(0)
    row = rng.integers(0, 4, size=257)
    row[150:230] = row[20:100]
    inputs = torch.from_numpy(row[None, :-1]).long()
    targets = torch.from_numpy(row[None, 1:]).long()
    keys = torch.from_numpy(oracle_keys(row[None, :-1], 12))

    def loss_and_grads(m):
        m.zero_grad()
        logits = m(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain_loss, _ = loss_and_grads(model)
    with selection_oracle(model, keys):
        oracle_loss, oracle_grads = loss_and_grads(model)
    assert not torch.allclose(plain_loss, oracle_loss)
    assert all(layer.self_attn.selection_oracle is None for layer in model.model.layers if hasattr(layer.self_attn, "indexer"))

    import copy

    recomputed = copy.deepcopy(model)
    apply_recompute(recomputed)
    with selection_oracle(recomputed, keys):
        again_loss, again_grads = loss_and_grads(recomputed)
    torch.testing.assert_close(again_loss, oracle_loss)
    for name, grad in oracle_grads.items():
        torch.testing.assert_close(again_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_finetune_with_the_oracle_a_small_topk_and_the_layer_dial(lambda_dna, tmp_path):
    options = tiny_options(lambda_dna.path, tmp_path / "r", steps=2, warmup=0, seq_len=256, copy_oracle=12, indexer_topk=8, layers=4,
                           indexer_loss_coeff=1.0, indexer_warmup_steps=1, planted_repeats="len=32,max-dist=200,per-window=2")
    records = loop.train(options)
    assert [r["indexer_phase"] for r in records] == ["warmup", "sparse"]
    assert all(np.isfinite(r["loss"]) for r in records)
    import json

    saved = json.loads((tmp_path / "r" / ck.CHECKPOINTS / "step_00000002" / "model" / "config.json").read_text())
    assert saved["text_config"]["index_topk"] == 8, "the saved model records the run's top-k"
    assert len(read_jsonl(tmp_path / "r" / ck.METRICS_FILE)) == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"copy_oracle": 5}, "k-mer length must be in 8"),
        ({"indexer_topk": 0}, "--indexer-topk must be positive"),
        ({"layers": 0}, "layer dial"),
        ({"copy_oracle": 12, "parallel": "cp=2"}, "--copy-oracle runs on whole sequences"),
    ],
)
def test_bad_long_range_options_are_one_line(data, tmp_path, change, message):
    with pytest.raises(GenolongError, match=message):
        tiny_options(data, tmp_path / "r", **change).validate()
