"""Kept results under recompute on a CUDA GPU (skipped without one): glm53-mini at 4 layers with
every hot op fused, the recompute replaying the Triton sparse attention and the fused selection
from pinned host memory, against the same step recomputing everything."""

import gc

import pytest
import torch

import genolong.kernels as kernels
from genolong.model import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_kept_sparse_attention_from_pinned_memory_trains_like_a_full_recompute():
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.options import MemoryOptions

    kernels.load()
    torch.manual_seed(0)
    cfg = get_preset("glm53-mini", num_layers=8)
    n_dsa = len(cfg.dsa_layers)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    tokens = torch.randint(0, 4, (1, 16385), device=DEV)

    def step(keep):
        memory = apply_memory_optimizations(model, MemoryOptions(keep_sparse=keep))
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

    full_loss, full_grad, _, _, _, _ = step("off")
    kept_loss, kept_grad, policy, stats, parked, after = step("host")
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
