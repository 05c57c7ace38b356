"""Tensor parallelism together with context parallelism (cp=2 x tp=2, 4 gloo processes, fp32)
against one process with the same weights and sequences, through the real passes (`parallelize`).

Each rank reads its cp shard of both sequences, tp cuts it further (sequence parallelism), and the
mixers run on the cp shard with this tp rank's heads (genolong/parallel/context_tensor.py). Per-token
losses and every parameter's summed gradient must equal one process's, for `tiny` (KDA by state
passing: its 2 KDA heads leave one per tp rank) and for a preset with GLM-5.3-Flash's head ratios
(8 KDA heads: 4 per tp rank, split again by Ulysses), with full-layer recompute and MoE chunks in
the second. As in the tp and cp tests, each indexer's selections are pinned to the reference's
(rounding upstream can flip a near tie) and compared separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genolong.model import get_preset
from genolong.model.model import GenoLongForCausalLM
from tests.parallel.bf16_error import rel_rmse
from tests.parallel.context_workers import MINI
from tests.parallel.harness import run_ranks
from tests.parallel.tensor_expert_workers import capture_selections, same_set_rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # four processes on two cores

SEQ, N = 512, 2  # a multiple of cp x tp x 64: whole KDA chunks and indexer pools per piece


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    overrides: dict
    kda: str  # the KDA mode "auto" must pick
    recompute: bool = False


CASES = [Case("tiny", "tiny", {}, "state"), Case("mini", "glm53-mini", MINI, "ulysses", recompute=True)]


def _build(case: Case) -> GenoLongForCausalLM:
    torch.manual_seed(0)
    return GenoLongForCausalLM(get_preset(case.preset, **case.overrides))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (N, SEQ), generator=g)
    targets = torch.randint(0, 5, (N, SEQ), generator=g)
    weights = torch.rand(N, SEQ, generator=g) + 0.5
    return ids, targets, weights


def _losses(model, ids, targets) -> torch.Tensor:
    hidden = model.hidden_states(ids)
    logits = hidden @ model.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def _one_process(case: Case) -> dict:
    model = _build(case)
    seen = capture_selections(model)
    ids, targets, weights = _batch()
    losses = _losses(model, ids, targets)
    (losses * weights).sum().backward()
    return {
        "losses": losses.detach().numpy(),
        "grads": {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None},
        "selections": {layer: np.concatenate(v) for layer, v in seen.items()},
    }


def _rank(rank, world, cases, pins, layout="cp=2,tp=2"):
    from genolong.parallel.context import gather_sequence, shard_sequence
    from genolong.parallel.layout import parse_layout
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.tensor_state import full_state_dict
    from genolong.train.options import MemoryOptions, TrainOptions
    from genolong.train.passes import parallelize

    pmesh = build_mesh(parse_layout(layout), "cpu")
    cp_group, cp, size = pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")
    out = {}
    for case in cases:
        model = _build(case)
        memory = MemoryOptions(recompute=case.recompute, offload=False, moe_chunk_tokens=100)
        parallel = parallelize(model, TrainOptions(memory=memory, compile=False), pmesh)
        pin = {layer: np.ascontiguousarray(shard_sequence(torch.from_numpy(rows), cp, size).numpy()) for layer, rows in pins[case.name].items()}
        seen = capture_selections(model, pin)
        ids, targets, weights = (shard_sequence(t, cp, size) for t in _batch())
        losses = _losses(model, ids, targets)
        (losses * weights).sum().backward()
        parallel.grads.reduce()
        grads = full_state_dict({n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}, pmesh)
        out[case.name] = {
            "losses": gather_sequence(losses.detach(), cp_group).numpy(),
            "selections": {layer: gather_sequence(torch.from_numpy(v[0]), cp_group).numpy() for layer, v in seen.items()},  # (a recompute selects again)
            "grad_norm": parallel.grads.grad_norm(lambda: float("nan")),
            "grad_none": sorted(n for n, p in model.named_parameters() if p.grad is None),
            "exact_indexer": _exact_indexer(case, pmesh),
        }
        if rank == 0:
            out[case.name]["grads"] = {n: g.numpy() for n, g in grads.items()}
            out[case.name]["repr"] = repr(model)
    return out


def _exact_indexer(case: Case, pmesh) -> bool:
    """The tp x cp indexer (its tp part of its cp shard's queries, keys gathered over tp and cp) on
    the same input as the plain indexer over the whole sequence, float64: every query selects pools
    of the same total score and the same tail. (Not the same pools: with few indexer heads many
    pools score exactly 0 after the ReLU, and which of those tied pools fill the top-k depends on
    the call's shape, as it does at tp or cp alone.)"""
    import torch.nn.functional as F

    from genolong.model.indexer import Indexer
    from genolong.model.indexer_loss import selected_pools
    from genolong.parallel.context import apply_context_parallel, gather_sequence, shard_sequence
    from genolong.parallel.context_tensor import TensorContextParallelDSA
    from genolong.parallel.tensor import apply_tensor_parallel

    model = apply_context_parallel(apply_tensor_parallel(_build(case).double(), pmesh), pmesh)
    layer = next(m for m in model.modules() if isinstance(m, TensorContextParallelDSA) and m.indexer is not None)
    indexer, cfg = layer.indexer, layer.indexer.cfg
    g = torch.Generator().manual_seed(6)
    x = torch.randn(N, SEQ, model.config.hidden, generator=g, dtype=torch.float64)
    q_resid = torch.randn(N, SEQ, model.config.dsa.q_lora_rank, generator=g, dtype=torch.float64)
    cp, size = pmesh.rank("cp"), pmesh.size("cp")
    mine = indexer(shard_sequence(x, cp, size), shard_sequence(q_resid, cp, size), piece=layer.cp.piece(SEQ // size))
    got, whole = gather_sequence(mine, pmesh.group("cp")), Indexer.forward(indexer, x, q_resid)
    proj = indexer.project(x, q_resid)
    scores = torch.einsum("bthd,bpd->bthp", proj.index_q, proj.pool_keys) * indexer.softmax_scale
    scores = torch.einsum("bth,bthp->btp", proj.head_weights.double(), F.relu(scores))

    def selected_score(selection):
        pools, valid = selected_pools(selection, cfg.kpool, cfg.topk_pools)
        return (scores.gather(-1, pools) * valid).sum(-1)

    pooled = cfg.topk_pools * cfg.kpool
    return bool(torch.allclose(selected_score(got), selected_score(whole), rtol=1e-12, atol=1e-12)
                and torch.equal(got[..., pooled:], whole[..., pooled:])
                and torch.equal(got[..., :pooled] >= 0, whole[..., :pooled] >= 0))


@pytest.fixture(scope="module")
def cp2tp2():
    refs = {case.name: _one_process(case) for case in CASES}
    pins = {name: ref["selections"] for name, ref in refs.items()}
    return refs, run_ranks(_rank, 4, CASES, pins, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_losses_and_every_gradient_equal_one_process(cp2tp2, case):
    refs, results = cp2tp2
    ref = refs[case.name]
    for r in results:  # every rank returns the whole sequence's losses (gathered over cp)
        assert np.abs(r[case.name]["losses"] - ref["losses"]).max() < 1e-5
    grads = results[0][case.name]["grads"]
    keys = sorted(ref["grads"])
    flat = lambda g: np.concatenate([np.asarray(g[k], np.float64).ravel() for k in keys])  # noqa: E731
    assert rel_rmse(flat(grads), flat(ref["grads"])) < 1e-5
    worst = max((rel_rmse(grads[k], ref["grads"][k]), k) for k in keys)
    assert worst[0] < 1e-4, worst
    # The frozen indexer has no gradient in one process and only zeros here.
    assert all(not np.any(grads[k]) for k in set(grads) - set(keys))
    norm = float(np.linalg.norm(flat(ref["grads"])))
    assert all(abs(r[case.name]["grad_norm"] - norm) < 1e-5 * norm for r in results)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_rank_runs_the_tp_x_cp_mixers_and_selects_as_one_process(cp2tp2, case):
    refs, results = cp2tp2
    text = results[0][case.name]["repr"]
    assert "TensorContextParallelKDA" in text and "TensorContextParallelDSA" in text and "SequenceShardedIndexer" in text
    assert ("Ulysses head split" in text) == (case.kda == "ulysses") and ("state passing" in text) == (case.kda == "state")
    assert all(r[case.name]["exact_indexer"] for r in results)
    # End to end the layer's input differs by rounding, which can flip a near tie: almost every
    # row agrees (the mini preset's ReLU scores tie often: 22 of its 1024 rows differ here, 22 at
    # cp=2 alone and 14 at tp=2 alone, each a pool swapped for another).
    for r in results:
        for layer, rows in refs[case.name]["selections"].items():
            got = r[case.name]["selections"][layer]
            assert got.shape == rows.shape
            assert same_set_rows(got, rows).mean() > (0.99 if case.name == "tiny" else 0.97)
