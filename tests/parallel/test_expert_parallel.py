"""Expert parallelism (ep=2) and tensor x expert parallelism (tp=2 x ep=2, 4 processes) against one process.

Each ep rank holds half of the routed experts and reads its own sequence (ep ranks are data
parallel for everything else); tokens reach their experts by all-to-all. Compared with the
plain model on both sequences: per-token losses and the gradient of every parameter (experts
summed over dp x cp x tp, the rest over their groups), under even and fully skewed routing (one
rank receives every token, the other none), with the MoE in checkpointed chunks under full-layer
recompute, in fp32 and bf16, and a checkpoint saved at tp=2 x ep=2 loaded by one process.
"""

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.parallel.harness import run_ranks
from tests.parallel.tensor_expert_workers import Case, build, check_bf16, check_fp32, one_process, parallel

# Starting two and four gloo processes and running every case takes ~30-90 s on the shared 2-core machine.
pytestmark = pytest.mark.slow

N = 2  # sequences: one per ep rank
EP_CASES = [Case("fp32"), Case("skewed", skew=4), Case("memory", memory=True)]
MIXED_CASES = [Case("fp32"), Case("bf16", dtype="bf16"), Case("memory", memory=True, skew=2)]


def _references(cases):
    refs = {case.name: one_process(case, N) for case in cases}
    return refs, {name: ref["selections"] for name, ref in refs.items()}


@pytest.fixture(scope="module")
def ep2():
    refs, pins = _references(EP_CASES)
    return refs, run_ranks(parallel, 2, "ep=2", EP_CASES, N, pins)


@pytest.fixture(scope="module")
def tp2ep2(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tp2ep2")
    dcp.save(build("fp32", seed=7).state_dict(), checkpoint_id=str(ckpt / "single"))
    refs, pins = _references(MIXED_CASES)
    refs["fp32_for_bf16"] = refs["fp32"]
    return refs, run_ranks(parallel, 4, "tp=2,ep=2", MIXED_CASES, N, pins, str(ckpt)), ckpt


def test_ep2_equals_one_process(ep2):
    refs, results = ep2
    check_fp32(refs["fp32"], results, "fp32")
    assert all(r["fp32"]["imbalance"][3] < 1.5 for r in results)


def test_ep2_skewed_routing_one_rank_gets_every_token(ep2):
    refs, results = ep2
    check_fp32(refs["skewed"], results, "skewed")
    # Every token picked two of experts 0-3, all on ep rank 0: it received all rows (2x the mean) ...
    assert all(r["skewed"]["imbalance"] == {3: 2.0} for r in results)
    # ... and rank 1's experts none: its empty exchanges still joined in, and after the reduce its
    # slice holds a zero gradient, not none (one process's whole [E, ...] tensor has a gradient, so
    # weight decay and the optimizer moments move every expert; check_fp32 compared the values).
    assert all("model.layers.3.mlp.experts.gate_up_proj" not in r["skewed"]["grad_none"] for r in results)


def test_ep2_moe_chunks_under_recompute_dispatch_per_chunk(ep2):
    refs, results = ep2
    check_fp32(refs["fp32"], results, "memory")


def test_expert_counts_summed_over_every_routing_rank(ep2, tp2ep2):
    _, results = ep2
    assert all(np.all(np.array(r["global_counts"]) == 1 + 2) for r in results)
    _, results, _ = tp2ep2
    assert all(np.all(np.array(r["global_counts"]) == 1 + 2 + 3 + 4) for r in results)


def test_tp2_ep2_fp32_equals_one_process(tp2ep2):
    refs, results, _ = tp2ep2
    check_fp32(refs["fp32"], results, "fp32")
    assert all(r["exact_indexer"] for r in results)


def test_tp2_ep2_bf16_adds_no_error_beyond_bf16s_own(tp2ep2):
    refs, results, _ = tp2ep2
    check_bf16(refs["bf16"], refs["fp32_for_bf16"], results, "bf16")


def test_tp2_ep2_memory_passes_and_uneven_routing(tp2ep2):
    refs, results, _ = tp2ep2
    check_fp32(refs["memory"], results, "memory")
    assert all(r["memory"]["imbalance"][3] == 2.0 for r in results)


def test_tp2_ep2_each_rank_holds_its_experts(tp2ep2):
    _, results, _ = tp2ep2
    shapes = results[0]["fp32"]["local_shapes"]
    assert shapes["model.layers.3.mlp.experts.gate_up_proj"] == (4, 64, 64)
    assert shapes["model.layers.3.mlp.experts.down_proj"] == (4, 64, 32)
    assert shapes["model.layers.3.mlp.gate.weight"] == (8, 64)  # the router sees every expert
    assert "ExpertParallelExperts(ep rank 0 of 2, experts 0..3, all-to-all dispatch)" in results[0]["fp32"]["repr"]


def test_checkpoint_saved_at_tp2_ep2_loads_in_one_process_and_back(tp2ep2):
    _, results, ckpt = tp2ep2
    saved = build("fp32", seed=0).state_dict()
    target = build("fp32", seed=9).state_dict()
    dcp.load(target, checkpoint_id=str(ckpt / "parallel"))
    for key, value in saved.items():
        assert torch.equal(target[key], value), key
    single = build("fp32", seed=7).state_dict()
    loaded = results[0]["loaded"]
    for key, value in single.items():
        assert np.array_equal(loaded[key], value.numpy()), key
