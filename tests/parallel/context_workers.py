"""What each rank runs in the context-parallel tests, and the one-process reference it is compared with.

Every rank builds the same model (same seed), applies context parallelism, runs its shard of the
same sequences (inputs and shifted targets sharded together, valid masks with them), divides its
loss sum by the valid count of the whole batch (summed over the cp group), backpropagates and
sums gradients over the group. The reference runs the whole sequences through the plain model in
one process. A run is a list of cases, so that one start of the processes serves several.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from genolong.model import get_preset
from genolong.model.indexer import Indexer
from genolong.model.model import GenoLongForCausalLM
from genolong.train.loss import chunked_token_loss
from genolong.vocab import N_ID

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A small preset with GLM-5.3-Flash's head ratios at CPU size: 8 KDA heads (64 in the real model),
# 8 DSA heads with 4 indexer heads (64 / 32), a 3-layer KDA run before the DSA layer.
MINI = {
    "num_layers": 4,
    "hidden": 128,
    "kda": {"num_heads": 8, "head_dim": 16},
    "dsa": {"num_heads": 8, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16, "v_head_dim": 16,
            "indexer": {"n_heads": 4, "head_dim": 16, "topk": 64, "kpool": 4}},
    "moe": {"num_experts": 8, "top_k": 2, "expert_dim": 32},
    "dense_mlp": {"intermediate_size": 128},
}
PRESETS = {"tiny": ("tiny", {}), "mini": ("glm53-mini", MINI)}


@dataclass(frozen=True)
class Case:
    name: str
    preset: str = "tiny"
    kda_mode: str = "state"  # (the tests name the mode; "auto" is tested in test_context_plan.py)
    dtype: str = "fp32"
    seq: int = 512
    batch: int = 1
    uneven_n: bool = False  # N bases concentrated in the first part of the sequence
    indexer_loss: str = ""  # "", "sparse" or "dense": the indexer's KL loss switched on
    query_fraction: float = 1.0  # the sparse KL's share of query blocks (of query_block queries)
    query_block: int | None = None
    recall: bool = False  # measure the indexer's recall (genolong/model/indexer_recall.py)
    pin: bool = False  # replace each indexer's selections by the reference's
    balance: bool = True  # the indexer's scoring in zigzag blocks (genolong/parallel/context_dsa.py)
    memory: bool = False  # full-layer recompute and MoE chunking (genolong.train.memory) after CP


def build(case: Case, seed: int = 0) -> GenoLongForCausalLM:
    name, overrides = PRESETS[case.preset]
    torch.manual_seed(seed)
    model = GenoLongForCausalLM(get_preset(name, **overrides))
    if case.dtype != "fp32":
        model.to_dtype(DTYPES[case.dtype])
    return model


def batch(case: Case, seed: int = 1):
    """(inputs, targets, valid) [B, T]: targets shifted by one; with `uneven_n` most N bases fall in
    the first quarter, so every cp rank has a different valid count."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (case.batch, case.seq + 1), generator=g)
    n_rate = torch.full((case.seq + 1,), 0.02)
    if case.uneven_n:
        n_rate[: (case.seq + 1) // 4] = 0.7
    tokens[torch.rand(case.batch, case.seq + 1, generator=g) < n_rate] = N_ID
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return inputs, targets, targets != N_ID


def switch_indexer(model, case: Case):
    """Set the indexer-loss switch and the recall probe on every DSA layer with an indexer, as
    genolong/train/indexer.py does; -> (switch or None, probe or None)."""
    from genolong.model.indexer_loss import IndexerLossSwitch
    from genolong.model.indexer_recall import RecallProbe

    switch = IndexerLossSwitch(mode=case.indexer_loss, coeff=0.5, query_fraction=case.query_fraction,
                               query_block=case.query_block, seed=2, step=1) if case.indexer_loss else None
    probe = RecallProbe(n_queries=64) if case.recall else None
    for module in model.modules():
        if getattr(module, "indexer", None) is not None and hasattr(module, "indexer_loss"):
            module.indexer_loss, module.recall_probe = switch, probe
    return switch, probe


def capture_selections(model, pin: dict | None = None, rank: int = 0) -> dict[int, list]:
    """Each indexer's int32 selections of this rank's query rows; with `pin`, replaced by those rows
    of the reference's (a near tie flipped by rounding upstream would otherwise change all that follows)."""
    seen: dict[int, list] = {}

    def hook(module, args, out):
        seen.setdefault(module.layer_idx, []).append(out.numpy().copy())
        if pin is not None:
            rows = out.shape[1]
            return torch.from_numpy(pin[module.layer_idx][:, rank * rows : (rank + 1) * rows].copy())
        return None

    for module in model.modules():
        if isinstance(module, Indexer):
            module.register_forward_hook(hook)
    return seen


def step(model, case: Case, inputs, targets, valid, count) -> tuple[torch.Tensor, dict]:
    """Forward, the loss sum over valid targets / count, backward; -> (per-token losses, indexer metrics)."""
    switch, probe = switch_indexer(model, case)
    masked = torch.where(valid, targets, -100)
    if case.indexer_loss == "dense":
        # The warm-up trains only the indexer: forward under no_grad, the KL's gradient applied inside.
        with torch.no_grad():
            per_token = chunked_token_loss(model.hidden_states(inputs), model.lm_head.weight, masked, 4096)
    else:
        per_token = chunked_token_loss(model.hidden_states(inputs), model.lm_head.weight, masked, 4096)
        (per_token.sum() / count).backward()
    metrics = {}
    if switch is not None:
        metrics["kl"] = {layer: float(v) for layer, v in switch.values.items()}
    if probe is not None:
        metrics["recall"] = dict(probe.values)
    return per_token.detach(), metrics


def _result(model, per_token, seen, metrics) -> dict:
    return {
        "losses": per_token.float().numpy(),
        "grads": {name: p.grad.float().numpy() for name, p in model.named_parameters() if p.grad is not None},
        "selections": {layer: np.concatenate(v, axis=1) for layer, v in seen.items()},
        **metrics,
    }


def one_process(case: Case) -> dict:
    model = build(case)
    seen = capture_selections(model)
    inputs, targets, valid = batch(case)
    per_token, metrics = step(model, case, inputs, targets, valid, valid.sum())
    out = _result(model, per_token, seen, metrics)
    out["valid_count"] = int(valid.sum())
    return out


def _run_case(pmesh, case: Case, pin: dict | None, rank: int) -> dict:
    from genolong.parallel.context import (
        apply_context_parallel, gather_sequence, global_valid_count, shard_batch, sum_gradients,
    )

    group, cp, size = pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")
    model = apply_context_parallel(build(case), pmesh, kda_mode=case.kda_mode, balance_indexer=case.balance)
    if case.memory:
        from genolong.train.memory import apply_memory_optimizations
        from genolong.train.options import MemoryOptions

        # The collectives of every mixer rerun inside backward (recompute), in the same order on every rank.
        apply_memory_optimizations(model, MemoryOptions(recompute=True, offload=False, moe_chunking=True, moe_chunk_tokens=100))
    seen = capture_selections(model, pin if case.pin else None, cp)
    inputs, targets, valid = shard_batch(*batch(case), cp, size)
    count = global_valid_count(valid, group)
    per_token, metrics = step(model, case, inputs, targets, valid, count)
    sum_gradients(model, group)
    out = _result(model, gather_sequence(per_token, group), {}, metrics)
    out["selections"] = {layer: gather_sequence(torch.from_numpy(np.concatenate(v, axis=1)), group).numpy()
                         for layer, v in sorted(seen.items())}
    out["valid_count"] = int(count)
    out["local_valid"] = int(valid.sum())
    if rank == 0:
        out["repr"] = repr(model)
        out["keys"] = list(model.state_dict())
    else:
        out.pop("grads")
    return out


def parallel(rank: int, world: int, cases: list[Case], pins: dict, extras: bool = False) -> dict:
    """One rank of a cp=world run: every case (pins[case.name]: the reference's selections); with
    `extras`, the layer-level checks and the refusals too."""
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh

    pmesh = build_mesh(ParallelLayout(cp=world), "cpu")
    out = {case.name: _run_case(pmesh, case, pins.get(case.name), rank) for case in cases}
    if extras:
        out["halo"] = halo_check(pmesh)
        out["conv"] = conv_check(pmesh)
        out["kda_layer"] = {mode: kda_layer_check(pmesh, mode) for mode in ("state", "ulysses")}
        out["dsa_layer"] = {balanced: dsa_layer_check(pmesh, balanced) for balanced in (False, True)}
        out["refusals"] = refusals(pmesh)
    return out


# ------------------------------------------------------------------------- layer-level checks
# float64 where the layer allows it, so that "equal" means equal to rounding of 1e-15.

SEQ_LAYER = 256


def _randn(seed: int, *shape, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def halo_check(pmesh) -> dict:
    """from_previous_rank: the previous rank's tensor (zeros on rank 0); its gradient goes back."""
    from genolong.parallel.collectives import from_previous_rank

    group, rank, size = pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")
    x = _randn(100 + rank, 2, 3, 5).requires_grad_()
    y = from_previous_rank(x, group)
    (y * _randn(200 + rank, 2, 3, 5)).sum().backward()
    expect = torch.zeros(2, 3, 5, dtype=torch.float64) if rank == 0 else _randn(100 + rank - 1, 2, 3, 5)
    grad = torch.zeros(2, 3, 5, dtype=torch.float64) if rank == size - 1 else _randn(200 + rank + 1, 2, 3, 5)
    return {"value": bool(torch.equal(y, expect)), "grad": bool(torch.equal(x.grad, grad))}


def conv_check(pmesh) -> dict:
    """The short conv of a shard with its halo against the whole sequence's conv: output, dx, dw."""
    from genolong.model.kda import short_conv_reference
    from genolong.parallel.context import gather_sequence, shard_sequence
    from genolong.parallel.context_kda import short_conv_cp_reference

    group, rank, size = pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")
    x, w, up = _randn(1, 2, SEQ_LAYER, 12), _randn(2, 12, 4), _randn(3, 2, SEQ_LAYER, 12)
    whole_x, whole_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    whole = short_conv_reference(whole_x, whole_w)
    (whole * up).sum().backward()
    whole = whole.detach()
    part_x, part_w = shard_sequence(x, rank, size).clone().requires_grad_(), w.clone().requires_grad_()
    part = short_conv_cp_reference(part_x, part_w, group=group)
    (part * shard_sequence(up, rank, size)).sum().backward()
    dw = part_w.grad.clone()
    torch.distributed.all_reduce(dw, group=group)
    return {
        "y": float((gather_sequence(part.detach(), group) - whole).abs().max()),
        "dx": float((gather_sequence(part_x.grad, group) - whole_x.grad).abs().max()),
        "dw": float((dw - whole_w.grad).abs().max()),
    }


def _layer_result(pmesh, module, x, up, out_of) -> dict:
    """Run `module` on this rank's shard of x (or whole, without pmesh), backprop <out, up>; the outputs,
    input gradient and summed parameter gradients, whole."""
    from genolong.parallel.context import gather_sequence, shard_sequence, sum_gradients

    if pmesh is not None:
        group, rank, size = pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")
        x, up = shard_sequence(x, rank, size), shard_sequence(up, rank, size)
    x = x.clone().requires_grad_()
    out = module(x)
    y, extra = out_of(out)
    (y * up).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    if pmesh is not None:
        sum_gradients(module, group)
        grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
        y, dx = gather_sequence(y.detach(), group), gather_sequence(x.grad, group)
        extra = None if extra is None else gather_sequence(extra, group)
    else:
        y, dx = y.detach(), x.grad
    return {"y": y.numpy(), "dx": dx.numpy(), "grads": {k: v.numpy() for k, v in grads.items()},
            "extra": None if extra is None else extra.numpy()}


def kda_layer(seed: int = 0):
    """A KDA layer (8 heads, so cp=2 and cp=4 Ulysses splits) with O(1) random weights, float64."""
    from genolong.model import get_preset
    from genolong.model.kda import KimiDeltaAttention

    cfg = get_preset("tiny", kda={"num_heads": 8, "head_dim": 8})
    torch.manual_seed(seed)
    module = KimiDeltaAttention(cfg.hidden, cfg.kda, 1e-5, 0).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module, _randn(11, 2, SEQ_LAYER, cfg.hidden), _randn(12, 2, SEQ_LAYER, cfg.hidden)


def kda_layer_check(pmesh, mode: str) -> dict:
    from genolong.parallel.context_group import ContextGroup
    from genolong.parallel.context_kda import ContextParallelKDA

    module, x, up = kda_layer()
    module.__class__ = ContextParallelKDA
    module.cp, module.kda_mode = ContextGroup(pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")), mode
    return _layer_result(pmesh, module, x, up, lambda out: (out, None))


def kda_layer_reference() -> dict:
    module, x, up = kda_layer()
    return _layer_result(None, module, x, up, lambda out: (out, None))


def dsa_layer(seed: int = 0):
    """tiny's DSA layer with its indexer and O(1) random weights, float64; T = 256 > top-k: really sparse."""
    from genolong.model import get_preset
    from genolong.model.dsa import DSAAttention

    cfg = get_preset("tiny")
    torch.manual_seed(seed)
    module = DSAAttention(cfg.hidden, cfg.dsa, 1e-5, 3, has_indexer=True).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module, _randn(21, 2, SEQ_LAYER, cfg.hidden), _randn(22, 2, SEQ_LAYER, cfg.hidden)


def dsa_layer_check(pmesh, balanced: bool) -> dict:
    from genolong.parallel.context_group import ContextGroup
    from genolong.parallel.context_dsa import BalancedIndexer, ContextParallelDSA

    module, x, up = dsa_layer()
    module.__class__ = ContextParallelDSA
    module.cp = ContextGroup(pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp"))
    if balanced:
        module.indexer.__class__ = BalancedIndexer
        module.indexer.cp = module.cp
    return _layer_result(pmesh, module, x, up, lambda out: out)


def dsa_layer_reference() -> dict:
    module, x, up = dsa_layer()
    return _layer_result(None, module, x, up, lambda out: out)


def refusals(pmesh) -> list[str]:
    """The one-line errors for what a cp run cannot take."""
    from genolong.errors import GenolongError
    from genolong.parallel.context import apply_context_parallel, shard_batch
    from genolong.parallel.layout import ParallelLayout, check_layout, required_multiple

    size = pmesh.size("cp")
    config = get_preset("tiny")
    messages = []

    def refused(fn) -> None:
        try:
            fn()
            messages.append("")
        except GenolongError as err:
            messages.append(str(err))

    layout = ParallelLayout(cp=size)
    multiple = required_multiple(layout, config.dsa.indexer.kpool)
    refused(lambda: check_layout(layout, config, seq_len=multiple + 64, batch=1))
    ids = torch.zeros(1, multiple + 64, dtype=torch.long)
    refused(lambda: shard_batch(ids, ids, ids > 0, 0, size, multiple=multiple // size))
    refused(lambda: check_layout(ParallelLayout(cp=size), get_preset("tiny", kda={"num_heads": 3}), seq_len=multiple,
                                 batch=1, kda_mode="ulysses"))
    refused(lambda: apply_context_parallel(apply_context_parallel(build(Case("x")), pmesh), pmesh))
    refused(lambda: apply_context_parallel(build(Case("x")), pmesh, kda_mode="heads"))
    return messages
