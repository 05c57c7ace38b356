"""Kept results under recompute on a CUDA GPU (skipped without one): glm53-mini at 4 layers with
every hot op fused, the recompute replaying the Triton sparse attention and the fused selection
from pinned host memory, against the same step recomputing everything; the MoE outputs kept
(keep_moe) against the MoE's chunk checkpoint."""

import gc

import pytest
import torch

import genolong.kernels as kernels
from genolong.model import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _fused_step(model, tokens, opts):
    """One step under the fused policy with these memory options: (loss, flat fp32 gradients, the
    policy, the keeper's stats, pinned bytes after the forward, pinned bytes after backward)."""
    from genolong.train.memory import apply_memory_optimizations

    memory = apply_memory_optimizations(model, opts)
    model.zero_grad(set_to_none=True)
    try:
        with ops.policy("fused") as policy:
            logits = model(tokens[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], tokens[0, 1:])
        parked = memory.pinned_bytes()
        del logits
        loss.backward()
        gc.collect()
        torch.cuda.synchronize()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return loss.item(), grads, policy, memory.keep.stats if memory.keep else None, parked, memory.pinned_bytes()
    finally:
        memory.remove()


def test_kept_sparse_attention_from_pinned_memory_trains_like_a_full_recompute():
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.train.options import MemoryOptions

    kernels.load()
    torch.manual_seed(0)
    cfg = get_preset("glm53-mini", num_layers=8)
    n_dsa = len(cfg.dsa_layers)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    tokens = torch.randint(0, 4, (1, 16385), device=DEV)

    full_loss, full_grad, _, _, _, _ = _fused_step(model, tokens, MemoryOptions(keep_sparse="off"))
    kept_loss, kept_grad, policy, stats, parked, after = _fused_step(model, tokens, MemoryOptions(keep_sparse="host"))
    assert policy.audit_summary()["dsa_sparse_attention"] == {"triton_sparse_mla": n_dsa}
    assert (stats.recorded, stats.replayed, stats.rerun) == (2 * n_dsa, 2 * n_dsa, 0)
    # Parked in pinned memory, a layer: the selection as 512 pools + 3 tail slots (int32), the output
    # [T, 4, 512] bf16 and the lse [T, 4] fp32 (genolong.model.kept_selection packs the selection).
    assert parked == n_dsa * 16384 * ((512 + 3) * 4 + 4 * 512 * 2 + 4 * 4) and after == 0
    rel = ((kept_grad - full_grad).norm() / full_grad.norm()).item()
    print(f"loss kept {kept_loss:.6f} full recompute {full_loss:.6f}; gradients differ by {rel:.2e}")
    assert abs(kept_loss - full_loss) <= 1e-4 * abs(full_loss)  # the same forward (up to atomic-add order)
    # Both bf16; only the atomic-add order of the sparse backward (and MoE) differs.
    assert rel <= 1e-2, rel


@pytest.mark.parametrize("packs", [True, False])
def test_the_deferred_pack_check_on_cuda_resolves_as_the_synchronous_one(packs):
    """The flag travels on its own stream to pinned memory: resolving must wait for it (the compute
    stream is kept busy first, so the answer arrives late) and choose what the synchronous check does."""
    from genolong.model.kept_selection import PendingPack, pack_selection, pack_selection_deferred

    pools = torch.arange(0, 4096, 2, device="cuda", dtype=torch.int32).view(1, 8, 256)  # 256 pools of 4 a row
    idx = torch.cat([(pools[..., None] * 4 + torch.arange(4, device="cuda", dtype=torch.int32)).flatten(-2),
                     torch.full((1, 8, 3), -1, device="cuda", dtype=torch.int32)], dim=-1)
    if not packs:
        idx[0, 5, :2] = idx[0, 5, :2].flip(0)
    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU work queued before the check
    pending = pack_selection_deferred(idx, kpool=4, topk_pools=256)
    assert isinstance(pending, PendingPack) and pending.value is idx
    kept = pending.resolve()
    want = pack_selection(idx, kpool=4, topk_pools=256)
    assert len(kept) == len(want) == (2 if packs else 1)
    assert all(torch.equal(a, b) for a, b in zip(kept, want))


def test_kept_moe_outputs_from_pinned_memory_train_like_the_chunk_checkpoint():
    """MemoryOptions.keep_moe on CUDA: the outputs parked in pinned memory, brought back for the
    recompute, the MoE run in its own backward with the fused kernels (genolong.train.keep_moe)."""
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.model.config import MLP_MOE
    from genolong.train.options import MemoryOptions

    kernels.load()
    torch.manual_seed(0)
    cfg = get_preset("glm53-mini", num_layers=6)
    n_moe = sum(1 for kind in cfg.mlp_types if kind == MLP_MOE)
    assert n_moe >= 2
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    tokens = torch.randint(0, 4, (1, 16385), device=DEV)

    chunk_loss, chunk_grad, _, _, parked_off, _ = _fused_step(model, tokens, MemoryOptions(moe_chunk_tokens=4096))
    kept_loss, kept_grad, policy, _, parked, after = _fused_step(model, tokens, MemoryOptions(moe_chunk_tokens=4096, keep_moe=True))
    assert set(policy.audit_summary()["moe_experts"]) != {ops.REFERENCE}
    assert parked - parked_off == n_moe * 16384 * cfg.hidden * 2 and after == 0  # the bf16 outputs, then all given back
    rel = ((kept_grad - chunk_grad).norm() / chunk_grad.norm()).item()
    print(f"loss kept {kept_loss:.6f} chunk checkpoint {chunk_loss:.6f}; gradients differ by {rel:.2e}")
    assert abs(kept_loss - chunk_loss) <= 1e-4 * abs(chunk_loss)  # the same forward (up to atomic-add order)
    assert rel <= 1e-2, rel
