"""Context parallelism on CUDA with NCCL (skipped without a GPU; the cp=2 tests need two).

- cp=1 (one GPU, a group of one process): fla's context-parallel kernels (the fused "kda_cp" and
  "kda_short_conv_cp") and the state-passing references (through fla's chunk kernel with an
  initial state), against the plain ops, outputs and gradients, bf16, glm53-mini's KDA shapes.
- cp=2 (two GPUs): a 4-layer glm53-mini model at 16k tokens under the fused kernel policy, both
  KDA modes (the state mode on fla's CP kernels), against one process on one GPU: per-token
  losses, every gradient, the indexer's selections, and the audit naming the kernels that ran.
- cp=2 x tp=2 (four GPUs): the same model and comparison with tp inside each cp shard
  (genolong/parallel/context_tensor.py), both KDA modes.
"""

from __future__ import annotations

import os
import queue as queue_module
import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.parallel.harness import free_port
from tests.parallel.tensor_expert_workers import rel_rmse, same_set_rows

pytestmark = pytest.mark.gpu

SEQ_LAYER = 8192
SEQ_MODEL = 16384


def _entry(rank, world, port, fn, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001  (reported by the parent with the traceback)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_nccl(fn, world: int, *args, timeout: float = 900.0) -> list:
    """`fn(rank, world, *args)` in `world` processes, one GPU each, joined by NCCL; results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, errors = {}, []
    try:
        for _ in range(world):
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue_module.Empty:
                errors.append(f"ranks {sorted(set(range(world)) - set(got))} did not finish within {timeout:.0f} s")
                break
            if status != "ok":
                errors.append(f"rank {rank} failed:\n{value}")
                break
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return [got[r] for r in range(world)]


def _recurrence_inputs(seq: int, heads: int = 4, dim: int = 128):
    """glm53-mini's KDA op inputs (bf16; g from the bounded gate, beta a sigmoid), requiring grad."""
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = (r(1, seq, heads, dim).bfloat16() for _ in range(3))
    gate = (-5.0 * torch.sigmoid(r(1, seq, heads, dim) - 3.0)).bfloat16()
    beta = torch.sigmoid(r(1, seq, heads)).bfloat16()
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def _op_result(fn, inputs, up) -> dict:
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    (out.float() * up).sum().backward()
    return {"out": out.detach().float().cpu().numpy(), "grads": [t.grad.float().cpu().numpy() for t in inputs]}


def _cp1_ops(rank, world):
    import genolong.kernels as kernels
    from genolong.model import ops
    from genolong.parallel.context_kda import kda_cp_reference, short_conv_cp_reference
    from genolong.parallel.context_kda_fla import kda_cp_fla, short_conv_cp_fla
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh

    kernels.load()
    group = build_mesh(ParallelLayout(cp=world), "cuda").group("cp")
    inputs = _recurrence_inputs(SEQ_LAYER)
    up = torch.randn(1, SEQ_LAYER, 4, 128, device="cuda")
    x = torch.randn(1, SEQ_LAYER, 1536, device="cuda").bfloat16()
    w = (torch.randn(1536, 4, device="cuda") * 0.5).requires_grad_()
    up_x = torch.randn(1, SEQ_LAYER, 1536, device="cuda")
    with ops.policy("fused"):
        return {
            "kda": _op_result(lambda *t: ops.call("kda", 0, *t), inputs, up),
            "kda_cp_reference": _op_result(lambda *t: kda_cp_reference(*t, group=group, layer=0), inputs, up),
            "kda_cp_fla": _op_result(lambda *t: kda_cp_fla(*t, group=group), inputs, up),
            "conv": _op_result(lambda a, b: ops.call("kda_short_conv", 0, a, b), [x, w], up_x),
            "conv_cp_reference": _op_result(lambda a, b: short_conv_cp_reference(a, b, group=group, layer=0), [x, w], up_x),
            "conv_cp_fla": _op_result(lambda a, b: short_conv_cp_fla(a, b, group=group), [x, w], up_x),
        }


def test_cp1_state_passing_ops_equal_the_plain_ops():
    """At cp=1 (a group of one) the CP ops are the plain ops: the reference through fla's chunk
    kernel with a widened value and an initial state, and fla's own CP kernels."""
    out = run_nccl(_cp1_ops, 1)[0]
    for plain, names in (("kda", ("kda_cp_reference", "kda_cp_fla")), ("conv", ("conv_cp_reference", "conv_cp_fla"))):
        for name in names:
            got, ref = out[name], out[plain]
            assert rel_rmse(got["out"], ref["out"]) < 1e-2, name
            for i, (a, b) in enumerate(zip(got["grads"], ref["grads"])):
                assert rel_rmse(a, b) < 2e-2, (name, i)


def _model():
    from genolong.model import get_preset
    from genolong.model.model import GenoLongForCausalLM

    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("glm53-mini", num_layers=4)).cuda()
    return model.to_dtype(torch.bfloat16)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 4, (1, SEQ_MODEL + 1), generator=g)
    return tokens[:, :-1].cuda(), tokens[:, 1:].cuda()


def _model_run(model, inputs, targets, count) -> tuple:
    from genolong.train.loss import chunked_token_loss

    seen = {}
    for m in model.modules():
        if type(m).__name__ in ("Indexer", "BalancedIndexer", "SequenceShardedIndexer"):
            m.register_forward_hook(lambda mod, a, o: seen.setdefault(mod.layer_idx, o.detach().cpu().numpy()))
    per_token = chunked_token_loss(model.hidden_states(inputs), model.lm_head.weight, targets, 8192)
    (per_token.sum() / count).backward()
    return per_token.detach(), seen


def _one_gpu_reference(inputs, targets):
    """Per-token losses, selections and gradients of the whole model on one GPU (rank 0's reference)."""
    model = _model()
    per_token, seen = _model_run(model, inputs, targets, targets.numel())
    return {"losses": per_token.float().cpu().numpy(), "selections": seen,
            "grads": {n: p.grad.float().cpu().numpy() for n, p in model.named_parameters() if p.grad is not None}}


def _cp2_model(rank, world, kda_mode):
    import genolong.kernels as kernels
    from genolong.model import ops
    from genolong.parallel.context import apply_context_parallel, gather_sequence, shard_batch, sum_gradients
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh

    kernels.load()
    pmesh = build_mesh(ParallelLayout(cp=world), "cuda")
    group = pmesh.group("cp")
    inputs, targets = _batch()
    out = {}
    with ops.policy("fused"):
        if rank == 0:
            out["ref"] = _one_gpu_reference(inputs, targets)
        ops.reset_audit()
        model = apply_context_parallel(_model(), pmesh, kda_mode=kda_mode)
        mine = shard_batch(inputs, targets, targets >= 0, rank, world)
        per_token, seen = _model_run(model, mine[0], mine[1], targets.numel())
        sum_gradients(model, group)
        out["losses"] = gather_sequence(per_token, group).float().cpu().numpy()
        out["selections"] = {k: gather_sequence(torch.from_numpy(v).cuda(), group).cpu().numpy() for k, v in sorted(seen.items())}
        out["grads"] = {n: p.grad.float().cpu().numpy() for n, p in model.named_parameters() if p.grad is not None}
        out["audit"] = {op: name for (_, op), name in ops.audit().items()}
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kda_mode", ["state", "ulysses"])
def test_cp2_model_equals_one_gpu(kda_mode):
    _equals_one_gpu(run_nccl(_cp2_model, 2, kda_mode)[0], kda_mode)


def _equals_one_gpu(out, kda_mode):
    """Rank 0's result against its one-GPU reference: losses, every gradient, the indexer's
    selections, and the kernels the KDA mode should run."""
    ref = out["ref"]
    assert rel_rmse(out["losses"], ref["losses"]) < 1e-2
    keys = sorted(ref["grads"])
    flat = lambda grads: np.concatenate([grads[k].ravel() for k in keys])  # noqa: E731
    assert rel_rmse(flat(out["grads"]), flat(ref["grads"])) < 3e-2
    for layer, rows in ref["selections"].items():
        assert same_set_rows(out["selections"][layer], rows).mean() > 0.95
    if kda_mode == "state":
        assert out["audit"]["kda_cp"] == "fla_cp_chunk_kda" and out["audit"]["kda_short_conv_cp"] == "fla_cp_causal_conv1d"
    else:
        assert out["audit"]["kda"] == "fla_chunk_kda" and "kda_cp" not in out["audit"]


def _cp2_tp2_model(rank, world, kda_mode):
    import genolong.kernels as kernels
    from genolong.model import ops
    from genolong.parallel.context import apply_context_parallel, gather_sequence, shard_batch
    from genolong.parallel.layout import ParallelLayout
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.tensor import apply_tensor_parallel
    from genolong.parallel.tensor_grads import reduce_gradients
    from genolong.parallel.tensor_state import full_state_dict

    kernels.load()
    pmesh = build_mesh(ParallelLayout(cp=2, tp=2), "cuda")
    group, cp = pmesh.group("cp"), pmesh.rank("cp")
    inputs, targets = _batch()
    out = {}
    with ops.policy("fused"):
        if rank == 0:
            out["ref"] = _one_gpu_reference(inputs, targets)
        ops.reset_audit()
        model = apply_context_parallel(apply_tensor_parallel(_model(), pmesh), pmesh, kda_mode=kda_mode)
        mine = shard_batch(inputs, targets, targets >= 0, cp, 2)
        per_token, seen = _model_run(model, mine[0], mine[1], targets.numel())
        reduce_gradients(model, pmesh)
        grads = full_state_dict({n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in model.named_parameters()}, pmesh)
        out["losses"] = gather_sequence(per_token, group).float().cpu().numpy()
        out["selections"] = {k: gather_sequence(torch.from_numpy(v).cuda(), group).cpu().numpy() for k, v in sorted(seen.items())}
        out["grads"] = {n: g.float().cpu().numpy() for n, g in grads.items()}
        out["audit"] = {op: name for (_, op), name in ops.audit().items()}
        out["repr"] = repr(model)
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
@pytest.mark.parametrize("kda_mode", ["state", "ulysses"])
def test_cp2_tp2_model_equals_one_gpu(kda_mode):
    out = run_nccl(_cp2_tp2_model, 4, kda_mode)[0]
    assert "TensorContextParallelKDA" in out["repr"] and "TensorContextParallelDSA" in out["repr"]
    _equals_one_gpu(out, kda_mode)
