"""Tensor parallelism (tp=2, sequence parallel) against one process with the same weights and sequences.

One start of two gloo processes serves every test here (module fixture): fp32 and bf16 cases,
the indexer's selections, the refused lengths, and a checkpoint saved at tp=2 and loaded by one
process (and the reverse).
"""

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.parallel.harness import run_ranks
from tests.parallel.tensor_expert_workers import SEQ, Case, build, check_bf16, check_fp32, one_process, parallel, same_set_rows

# Starting two gloo processes and running every case takes ~30-90 s on the shared 2-core machine.
pytestmark = pytest.mark.slow

N = 2  # sequences; at tp=2 both ranks read both
CASES = [Case("fp32"), Case("bf16", dtype="bf16")]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tp2")
    refs = {case.name: one_process(case, N) for case in CASES}
    dcp.save(build("fp32", seed=7).state_dict(), checkpoint_id=str(ckpt / "single"))
    pins = {name: ref["selections"] for name, ref in refs.items()}
    results = run_ranks(parallel, 2, "tp=2", CASES, N, pins, str(ckpt))
    return refs, results, ckpt


def test_fp32_losses_and_every_gradient_equal_one_process(tp2):
    refs, results, _ = tp2
    check_fp32(refs["fp32"], results, "fp32")


def test_bf16_adds_no_error_beyond_bf16s_own(tp2):
    refs, results, _ = tp2
    check_bf16(refs["bf16"], refs["fp32"], results, "bf16")


def test_indexer_selections(tp2):
    refs, results, _ = tp2
    # On the same input the sharded indexer (own queries, gathered pool keys, gathered int32
    # selections) picks exactly what the plain one does.
    assert all(r["exact_indexer"] for r in results)
    # End to end the layer's input differs by rounding, which can flip a near tie: almost all rows agree.
    for r in results:
        for layer, rows in refs["fp32"]["selections"].items():
            assert rows.shape == r["fp32"]["selections"][layer].shape == (N, SEQ, 35)
            assert same_set_rows(r["fp32"]["selections"][layer], rows).mean() > 0.99


def test_each_rank_holds_half_of_the_split_parameters(tp2):
    _, results, _ = tp2
    shapes = results[0]["fp32"]["local_shapes"]
    full = {name: tuple(p.shape) for name, p in build("fp32").named_parameters()}
    assert shapes.keys() == full.keys()  # state-dict keys unchanged
    half_rows = tuple(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "conv1d", "b_proj", "g_b_proj", "q_b_proj", "kv_b_proj"))
    half_rows += ("forget_gate.f_b_proj.weight", "forget_gate.dt_bias", "forget_gate.A_log", "gate_proj.weight", "up_proj.weight")
    for name, shape in shapes.items():
        if name.endswith(half_rows):
            assert shape[0] * 2 == full[name][0] and shape[1:] == full[name][1:], name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert shape[1] * 2 == full[name][1], name
        else:
            assert shape == full[name], name
    text = results[0]["fp32"]["repr"]
    for cls in ("SequenceShardedEmbedding", "TensorParallelKDA", "TensorParallelDSA", "SequenceShardedIndexer",
                "TensorParallelMLP", "SequenceGatheringRMSNorm"):
        assert cls in text


def test_checkpoint_saved_at_tp2_loads_in_one_process_and_back(tp2):
    _, results, ckpt = tp2
    saved = build("fp32", seed=0).state_dict()
    target = build("fp32", seed=9).state_dict()
    dcp.load(target, checkpoint_id=str(ckpt / "parallel"))
    for key, value in saved.items():
        assert torch.equal(target[key], value), key
    # The tp=2 ranks loaded the one-process checkpoint of another seed into zeroed parts.
    single = build("fp32", seed=7).state_dict()
    loaded = results[0]["loaded"]
    assert loaded.keys() == single.keys()
    for key, value in single.items():
        assert np.array_equal(loaded[key], value.numpy()), key


def test_lengths_a_tp_shard_cannot_take_are_refused_in_one_line(tp2):
    _, results, _ = tp2
    odd, uneven_pools = results[0]["refusals"]
    assert "255 tokens do not split over 2 tp ranks" in odd
    assert "cuts an indexer pool of 4" in uneven_pools
    assert "\n" not in odd + uneven_pools
