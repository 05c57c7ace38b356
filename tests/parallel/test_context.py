"""Context parallelism (cp=2 and cp=4 on gloo) against one process with the same weights and sequences.

One start of the processes per cp size serves every test here (module fixtures). Cases: `tiny`
and a preset with GLM-5.3-Flash's head ratios (`mini`), both KDA modes, fp32 and bf16, batches
of one and two sequences, N bases concentrated in one shard, the indexer's sparse KL loss, its
dense warm-up and recall probe, and under full-layer recompute with MoE chunks. Comparisons follow fla's CP tests: fp32 to ~1e-5, bf16 by relative
RMSE ~1e-2.

The fp32 cases pin each indexer's selections to the reference's: rounding upstream (the KDA
state carried in fp32 in another order) can flip a query's near-tie between two pools, and a
different pool changes everything after it; the selections themselves are compared unpinned
(exactly at the layer level, end to end as a share of rows).
"""

import numpy as np
import pytest

from tests.parallel import context_workers as W
from tests.parallel.bf16_error import assert_bf16_error_no_worse
from tests.parallel.harness import run_ranks
from tests.parallel.tensor_expert_workers import rel_rmse, same_set_rows

# Four processes on the shared 2-core machine: ~1-2 minutes per start.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# The indexer's KL on 3 of the 6 blocks of 96 queries (the last of 32): blocks cross the shards'
# edges, and at cp=4 a shard may score none.
SUBSET = {"query_fraction": 0.5, "query_block": 96}

CP2 = [
    W.Case("tiny-state", kda_mode="state", pin=True, batch=2),
    W.Case("tiny-ulysses", kda_mode="ulysses", pin=True, balance=False),
    W.Case("tiny-state-bf16", dtype="bf16", pin=True),
    W.Case("tiny-ulysses-bf16", kda_mode="ulysses", dtype="bf16", pin=True),
    W.Case("mini-state-uneven", preset="mini", pin=True, uneven_n=True),
    W.Case("mini-ulysses", preset="mini", kda_mode="ulysses", pin=True),
    W.Case("tiny-sparse-kl", indexer_loss="sparse", recall=True, pin=True),
    W.Case("tiny-dense-warmup", indexer_loss="dense"),
    W.Case("tiny-state-recompute", pin=True, memory=True, indexer_loss="sparse"),
    W.Case("tiny-sparse-kl-subset", indexer_loss="sparse", pin=True, **SUBSET),
]
CP4 = [
    W.Case("tiny-state", pin=True),
    W.Case("mini-ulysses-uneven", preset="mini", kda_mode="ulysses", pin=True, uneven_n=True, memory=True),
    W.Case("mini-state-bf16", preset="mini", dtype="bf16", pin=True),
    W.Case("tiny-sparse-kl", indexer_loss="sparse", recall=True, pin=True),
    W.Case("tiny-sparse-kl-subset", indexer_loss="sparse", pin=True, **SUBSET),
]


def _references(cases):
    refs = {case.name: W.one_process(case) for case in cases}
    for case in cases:  # the fp32 run of every bf16 case: bf16's own error is the yardstick
        if case.dtype == "bf16":
            refs[case.name + "@fp32"] = W.one_process(W.Case(case.name, preset=case.preset, kda_mode=case.kda_mode))
    return refs


def _run(world, cases):
    refs = _references(cases)
    pins = {name: ref["selections"] for name, ref in refs.items()}
    return refs, run_ranks(W.parallel, world, cases, pins, True, timeout=600)


@pytest.fixture(scope="module")
def cp2():
    return _run(2, CP2)


@pytest.fixture(scope="module")
def cp4():
    return _run(4, CP4)


def _case(results, name):
    return results[0][name]


def check_fp32(ref: dict, got: dict) -> None:
    """Per-token losses within 1e-5; gradients within 1e-5 relative RMSE over the model and 1e-4 per
    tensor (gradients of small parameters summed over many tokens, e.g. mHC scales, cancel and lose digits)."""
    assert np.abs(got["losses"] - ref["losses"]).max() < 1e-5
    assert sorted(got["grads"]) == sorted(ref["grads"])
    keys = sorted(ref["grads"])
    flat = lambda grads: np.concatenate([grads[k].ravel() for k in keys])  # noqa: E731
    assert rel_rmse(flat(got["grads"]), flat(ref["grads"])) < 1e-5
    worst = max((rel_rmse(got["grads"][k], ref["grads"][k]), k) for k in keys)
    assert worst[0] < 1e-4, worst


def check_bf16(ref16: dict, ref32: dict, got: dict) -> None:
    """bf16: losses within 1e-2 relative RMSE of the one-process bf16 run; gradients by
    tests/parallel/bf16_error.py's rule (no error beyond the one-process bf16 run's own)."""
    assert rel_rmse(got["losses"], ref16["losses"]) < 1e-2
    assert_bf16_error_no_worse(got["grads"], ref16["grads"], ref32["grads"])


def _check_cases(refs, results, cases):
    for case in cases:
        got = _case(results, case.name)
        if case.dtype == "bf16":
            check_bf16(refs[case.name], refs[case.name + "@fp32"], got)
        elif case.indexer_loss != "dense":
            check_fp32(refs[case.name], got)


def test_cp2_losses_and_every_gradient_equal_one_process(cp2):
    _check_cases(*cp2, CP2)


def test_cp4_losses_and_every_gradient_equal_one_process(cp4):
    _check_cases(*cp4, CP4)


def test_one_global_valid_count_with_uneven_n(cp2, cp4):
    for (refs, results), name in ((cp2, "mini-state-uneven"), (cp4, "mini-ulysses-uneven")):
        local = [r[name]["local_valid"] for r in results]
        assert len(set(local)) > 1  # the shards really hold different numbers of valid targets
        assert all(r[name]["valid_count"] == refs[name]["valid_count"] == sum(local) for r in results)


def test_indexer_selections_equal_one_process(cp2, cp4):
    for refs, results in (cp2, cp4):
        # On the same layer input: exactly the single-process selections (layer level, below); end
        # to end, rounding upstream may flip a near tie: almost every query row agrees.
        for name in ("tiny-state", "tiny-ulysses") if results is cp2[1] else ("tiny-state",):
            for layer, rows in refs[name]["selections"].items():
                got = _case(results, name)["selections"][layer]
                assert got.shape == rows.shape
                assert same_set_rows(got, rows).mean() > 0.99


def _same_kl(got: float, ref: float) -> bool:
    """A layer's mean KL: near uniform at initialisation, so a small difference of O(1) terms per
    query (sum t log t and -sum t log p); their fp32 rounding gives ~1e-8 absolute."""
    return abs(got - ref) <= 1e-7 + 1e-4 * abs(ref)


def test_indexer_kl_loss_and_recall_equal_one_process(cp2, cp4):
    for refs, results in (cp2, cp4):
        ref, got = refs["tiny-sparse-kl"], [r["tiny-sparse-kl"] for r in results]
        assert ref["kl"] and ref["recall"]
        for r in got:  # every rank records the whole sequence's mean
            assert r["kl"].keys() == ref["kl"].keys()
            assert all(_same_kl(r["kl"][k], v) for k, v in ref["kl"].items())
            assert all(abs(r["recall"][k] - v) < 1e-5 for k, v in ref["recall"].items())
        indexer = [k for k in ref["grads"] if ".indexer." in k]
        assert indexer and all(rel_rmse(got[0]["grads"][k], ref["grads"][k]) < 1e-4 for k in indexer)


def test_a_query_subset_of_the_kl_equals_one_process(cp2, cp4):
    for refs, results in (cp2, cp4):
        ref, every = refs["tiny-sparse-kl-subset"], refs["tiny-sparse-kl"]
        assert ref["kl"].keys() == every["kl"].keys()
        assert all(abs(ref["kl"][k] / every["kl"][k] - 1) > 1e-3 for k in ref["kl"])  # a subset's mean, not every query's
        for r in results:
            got = r["tiny-sparse-kl-subset"]
            assert got["kl"].keys() == ref["kl"].keys() and all(_same_kl(got["kl"][k], v) for k, v in ref["kl"].items())
        indexer = [k for k in ref["grads"] if ".indexer." in k]
        got = results[0]["tiny-sparse-kl-subset"]
        assert indexer and all(rel_rmse(got["grads"][k], ref["grads"][k]) < 1e-4 for k in indexer)


def test_dense_warmup_trains_the_indexer_as_one_process(cp2):
    refs, results = cp2
    ref, got = refs["tiny-dense-warmup"], _case(results, "tiny-dense-warmup")
    assert set(ref["grads"]) == set(got["grads"]) and all(".indexer." in k for k in ref["grads"])
    assert all(rel_rmse(got["grads"][k], ref["grads"][k]) < 1e-4 for k in ref["grads"])
    assert got["kl"].keys() == ref["kl"].keys() and all(_same_kl(got["kl"][k], v) for k, v in ref["kl"].items())
    # Not pinned (the warm-up selects inside the layer): a flipped near tie moves a token's loss by ~1e-5.
    assert rel_rmse(got["losses"], ref["losses"]) < 1e-5


def _check_layer(ref: dict, got: dict, gate_tol: float = 0.0) -> None:
    """float64 layer: output and input gradient to 1e-12; parameter gradients to 1e-12 except the
    KDA gate's A_log / dt_bias, whose math runs in fp32 by design (genolong/model/kda.py)."""
    assert rel_rmse(got["y"], ref["y"]) < 1e-12
    assert rel_rmse(got["dx"], ref["dx"]) < 1e-12
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for k, g in ref["grads"].items():
        tol = gate_tol if k.endswith(("A_log", "dt_bias")) else 1e-12
        assert rel_rmse(got["grads"][k], g) < tol, k


def test_kda_layer_equals_one_process_in_both_modes(cp2, cp4):
    ref = W.kda_layer_reference()
    for _, results in (cp2, cp4):
        for mode in ("state", "ulysses"):
            _check_layer(ref, results[0]["kda_layer"][mode], gate_tol=1e-6)


def test_dsa_layer_selections_and_outputs_equal_one_process(cp2, cp4):
    ref = W.dsa_layer_reference()
    for _, results in (cp2, cp4):
        for balanced in (False, True):  # each rank scoring its own queries, or zigzag blocks
            got = results[0]["dsa_layer"][balanced]
            _check_layer(ref, got)
            assert np.array_equal(np.sort(got["extra"], -1), np.sort(ref["extra"], -1))  # the selections, exactly


def test_short_conv_halo(cp2, cp4):
    for _, results in (cp2, cp4):
        for r in results:
            assert r["halo"] == {"value": True, "grad": True}
            assert max(r["conv"].values()) < 1e-12, r["conv"]


def test_refusals_name_the_problem(cp2):
    messages = cp2[1][0]["refusals"]
    assert "must be a multiple of" in messages[0]
    assert "does not split into 2 context shards" in messages[1]
    assert "3 KDA heads do not split evenly over 2 ranks" in messages[2]
    assert "already applied" in messages[3]
    assert "'heads' is not one of auto, state, ulysses" in messages[4]
    assert all("\n" not in m for m in messages)


def test_keys_unchanged_and_the_pass_shows(cp2):
    _, results = cp2
    got = results[0]["tiny-state"]
    assert got["keys"] == list(W.build(W.Case("x")).state_dict())
    shown = [line.strip() for line in got["repr"].splitlines()]
    assert shown.count("(self_attn): ContextParallelKDA(") == 1  # layers 0-2, printed once as 3 x DecoderLayer
    assert shown[shown.index("(self_attn): ContextParallelKDA(") + 1] == "cp rank 0 of 2, state passing"
    assert shown[shown.index("(self_attn): ContextParallelDSA(") + 1].startswith("cp rank 0 of 2, own queries")
    assert "BalancedIndexer(" in got["repr"] and "scores zigzag blocks of queries" in got["repr"]
    assert "Ulysses head split" in results[0]["tiny-ulysses"]["repr"]
    assert "BalancedIndexer(" not in results[0]["tiny-ulysses"]["repr"]  # balance_indexer=False
