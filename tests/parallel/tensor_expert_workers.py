"""What each rank runs in the tp / ep tests, and the one-process reference it is compared with.

Every rank builds the same `tiny` model (same seed), applies tensor and/or expert parallelism,
runs its data-parallel replica's sequences (replica = the "batch" rank, dp x ep), backpropagates
a weighted sum of per-token losses, sums gradients over their groups and gathers them whole.
The reference runs the whole batch through the plain model in one process: its per-token losses
and gradients must equal the replicas' (the sum over replicas of their gradients).

A run is a list of cases (dtype, a skewed router, the memory passes), so that one start of the
processes serves several comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.model import get_preset
from genolong.model.indexer import Indexer
from genolong.model.model import GenoLongForCausalLM
from genolong.model.moe import Router
from tests.parallel.bf16_error import assert_bf16_error_no_worse, rel_rmse

SEQ = 256  # a multiple of 64 x tp: whole KDA chunks and indexer pools per tp shard
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str = "fp32"
    skew: int = 0  # > 0: every router prefers its first `skew` experts
    memory: bool = False  # full-layer recompute and MoE chunking (genolong.train.memory)


def build(dtype: str, seed: int = 0) -> GenoLongForCausalLM:
    torch.manual_seed(seed)
    model = GenoLongForCausalLM(get_preset("tiny"))
    if dtype != "fp32":
        model.to_dtype(DTYPES[dtype])
    return model


def skew_router(model: torch.nn.Module, experts_favoured: int) -> None:
    """Make every router pick among the first `experts_favoured` experts (the first ep rank's)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Router):
                module.e_score_correction_bias[:experts_favoured] += 10.0


def batch(n: int, seq: int = SEQ, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (n, seq), generator=g)
    targets = torch.randint(0, 5, (n, seq), generator=g)
    weights = torch.rand(n, seq, generator=g) + 0.5
    return ids, targets, weights


def capture_selections(model: torch.nn.Module, pin: dict[int, np.ndarray] | None = None) -> dict[int, list]:
    """Record each indexer's int32 selections; with `pin`, then replace them by pin[layer].

    Rounding differs between a split and a whole computation (sums in another order), so a
    query whose best pools nearly tie may pick another one, and everything after it differs;
    pinning the reference's selections makes the rest comparable at fp32 precision. The
    selections themselves are compared separately (`exact_indexer` and the end-to-end share)."""
    seen: dict[int, list] = {}

    def hook(module, args, out):
        seen.setdefault(module.layer_idx, []).append(out.numpy().copy())
        return None if pin is None else torch.from_numpy(pin[module.layer_idx])

    for module in model.modules():
        if isinstance(module, Indexer):
            module.register_forward_hook(hook)
    return seen


def same_set_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per query row: do the two selections hold the same indices (order is unspecified)?"""
    return (np.sort(a, -1) == np.sort(b, -1)).all(-1)


def per_token_losses(model, ids, targets) -> torch.Tensor:
    logits = model(ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def one_process(case: Case, n: int) -> dict:
    model = build(case.dtype)
    if case.skew:
        skew_router(model, case.skew)
    seen = capture_selections(model)
    ids, targets, weights = batch(n)
    losses = per_token_losses(model, ids, targets)
    (losses * weights).sum().backward()
    return {
        "losses": losses.detach().numpy(),
        "grads": {name: p.grad.float().numpy() for name, p in model.named_parameters() if p.grad is not None},
        "selections": {layer: np.concatenate(v) for layer, v in seen.items()},
    }


def _memory_passes(model) -> None:
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.options import MemoryOptions

    # 100-token MoE chunks: three dispatches per layer and rank, each under its own checkpoint.
    apply_memory_optimizations(model, MemoryOptions(recompute=True, offload=False, moe_chunking=True, moe_chunk_tokens=100))


def _run_case(pmesh, case: Case, n: int, pin: dict | None, rank: int) -> dict:
    from genolong.parallel.expert import apply_expert_parallel, dispatch_imbalance
    from genolong.parallel.tensor import apply_tensor_parallel
    from genolong.parallel.tensor_grads import global_grad_norm, reduce_gradients
    from genolong.parallel.tensor_state import full_state_dict

    model = build(case.dtype)
    if case.skew:
        skew_router(model, case.skew)
    apply_tensor_parallel(model, pmesh)
    apply_expert_parallel(model, pmesh)
    if case.memory:
        _memory_passes(model)
    replicas = pmesh.size("batch")
    mine = slice(pmesh.rank("batch") * n // replicas, (pmesh.rank("batch") + 1) * n // replicas)
    seen = capture_selections(model, None if pin is None else {layer: rows[mine] for layer, rows in pin.items()})

    ids, targets, weights = (t[mine] for t in batch(n))
    losses = per_token_losses(model, ids, targets)
    (losses * weights).sum().backward()
    reduce_gradients(model, pmesh)
    out = {
        "replica": pmesh.rank("batch"),
        "tp_rank": pmesh.rank("tp"),
        "losses": losses.detach().numpy(),
        "grad_norm": global_grad_norm(model, pmesh),
        "imbalance": dispatch_imbalance(model, pmesh),
        "selections": {layer: np.concatenate(v) for layer, v in seen.items()},
        "grad_none": sorted(name for name, p in model.named_parameters() if p.grad is None),
    }
    # (a rank whose experts received no token got zeros for them in the reduce; the slices are gathered)
    grads = full_state_dict({name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in model.named_parameters()}, pmesh)
    if rank == 0:
        out["grads"] = {name: g.float().numpy() for name, g in grads.items()}
        out["repr"] = repr(model)
        out["local_shapes"] = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return out


def exact_indexer(pmesh) -> bool:
    """The sharded indexer on the same input as the plain one: identical selections."""
    from genolong.parallel.tensor import SequenceShardedIndexer, apply_tensor_parallel

    model = apply_tensor_parallel(build("fp32"), pmesh)
    indexer = next(m for m in model.modules() if isinstance(m, SequenceShardedIndexer))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, SEQ, model.config.hidden, generator=g)
    q_resid = torch.randn(2, SEQ, model.config.dsa.q_lora_rank, generator=g)
    return bool(torch.equal(indexer(x, q_resid), Indexer.forward(indexer, x, q_resid)))


def refusals(pmesh) -> list[str]:
    """The one-line errors for sequence lengths a tp shard cannot take."""
    from genolong.parallel.tensor import apply_tensor_parallel

    model = apply_tensor_parallel(build("fp32"), pmesh)
    messages = []
    for seq in (255, 252):  # odd: no even split; 126-token shards: not whole indexer pools
        try:
            model(torch.zeros(1, seq, dtype=torch.long))
            messages.append("")
        except GenolongError as err:
            messages.append(str(err))
    return messages


def checkpoint_round_trip(pmesh, ckpt: str, rank: int) -> dict | None:
    """Save the seed-0 model at this layout; load the one-process checkpoint the test wrote
    (another seed) into zeroed parameters; return the loaded model whole (rank 0)."""
    import torch.distributed.checkpoint as dcp

    from genolong.parallel.expert import apply_expert_parallel
    from genolong.parallel.tensor import apply_tensor_parallel
    from genolong.parallel.tensor_state import full_state_dict, restore_from_sharded, sharded_state_dict

    model = apply_expert_parallel(apply_tensor_parallel(build("fp32"), pmesh), pmesh)
    dcp.save(sharded_state_dict(model.state_dict(), pmesh), checkpoint_id=str(Path(ckpt) / "parallel"))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    views = sharded_state_dict(model.state_dict(), pmesh)
    dcp.load(views, checkpoint_id=str(Path(ckpt) / "single"))
    restore_from_sharded(model.state_dict(), views, pmesh)
    loaded = full_state_dict(model.state_dict(), pmesh)
    return {key: t.numpy() for key, t in loaded.items()} if rank == 0 else None


def parallel(rank: int, world: int, layout_text: str, cases: list[Case], n: int, pins: dict, ckpt: str | None = None) -> dict:
    """One rank: every case (pins[case.name]: the reference's selections of the whole batch),
    then, for a tp layout, the indexer and refusal checks, and with `ckpt` the checkpoint round trip."""
    from genolong.parallel.layout import parse_layout
    from genolong.parallel.mesh import build_mesh

    pmesh = build_mesh(parse_layout(layout_text), "cpu")
    out: dict = {case.name: _run_case(pmesh, case, n, pins.get(case.name), rank) for case in cases}
    if pmesh.size("tp") > 1:
        out["exact_indexer"] = exact_indexer(pmesh)
        out["refusals"] = refusals(pmesh)
    if pmesh.size("ep") > 1:
        from genolong.parallel.expert import expert_count_reducer

        # The balancer's [layers, E] counts: rank r counted r + 1 tokens per expert.
        out["global_counts"] = expert_count_reducer(pmesh)(torch.full((2, 8), float(rank + 1))).tolist()
    if ckpt is not None:
        out["loaded"] = checkpoint_round_trip(pmesh, ckpt, rank)
    return out


# ----------------------------------------------------------------------------- comparisons


def replica_losses(results: list[dict], case: str) -> np.ndarray:
    """The whole batch's per-token losses from the replicas (tp rank 0 of each, in replica order)."""
    rows = sorted((r[case]["replica"], r[case]["losses"]) for r in results if r[case]["tp_rank"] == 0)
    return np.concatenate([losses for _, losses in rows])


def flat_grads(grads: dict, keys) -> np.ndarray:
    return np.concatenate([np.asarray(grads[k], np.float64).ravel() for k in keys])


def check_fp32(ref: dict, results: list[dict], case: str) -> None:
    """Per-token losses within 1e-5; gradients within 1e-5 relative RMSE over the model and 1e-4 per
    tensor (sums over many tokens of small parameters, e.g. mHC biases, cancel and lose digits)."""
    losses = replica_losses(results, case)
    assert np.abs(losses - ref["losses"]).max() < 1e-5
    for r in results:  # every tp rank of a replica returns the same (gathered) output
        same = [o[case]["losses"] for o in results if o[case]["replica"] == r[case]["replica"]]
        assert all(np.array_equal(same[0], s) for s in same)
    grads = results[0][case]["grads"]
    keys = sorted(ref["grads"])
    assert rel_rmse(flat_grads(grads, keys), flat_grads(ref["grads"], keys)) < 1e-5
    worst = max((rel_rmse(grads[k], ref["grads"][k]), k) for k in keys)
    assert worst[0] < 1e-4, worst
    # Parameters without a gradient in one process (the frozen indexer) get none here either.
    assert all(not np.any(grads[k]) for k in set(grads) - set(keys))
    norm = float(np.linalg.norm(flat_grads(ref["grads"], keys)))
    assert all(abs(r[case]["grad_norm"] - norm) < 1e-5 * norm for r in results)


def check_bf16(ref16: dict, ref32: dict, results: list[dict], case: str) -> None:
    """bf16: losses within 1e-2 relative RMSE of the one-process bf16 run; gradients by
    tests/parallel/bf16_error.py's rule (no error beyond the one-process bf16 run's own)."""
    assert rel_rmse(replica_losses(results, case), ref16["losses"]) < 1e-2
    assert_bf16_error_no_worse(results[0][case]["grads"], ref16["grads"], ref32["grads"])
