"""Sequence tiling on a CUDA GPU (skipped without one): glm53-mini at 8 layers in bf16 with every hot
op fused, tiled against whole layers. Inside tiles the same fused kernels must run (fla's chunk_kda
with the carried state, the short conv over the carried tail, the Triton indexer and sparse
attention with a tile's queries against the whole latent); loss and gradients agree to bf16
rounding, and the tiled backward's peak is below the whole layers'."""

import gc

import pytest
import torch

import genolong.kernels as kernels
from genolong.model import ops

# Tens of GiB each at 128k: call.sh's two GPU workers run every "gpu_memory" test on one worker, in turn.
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_memory")]
DEV = "cuda"
T = 16384


def _step(model, tokens, opts, indexer_loss=False):
    """One step under the fused policy: (loss, flat fp32 gradients, the policy, peak bytes of the step)."""
    from genolong.model.indexer_loss import SPARSE, IndexerLossSwitch
    from genolong.train.memory import apply_memory_optimizations

    for m in model.modules():
        if type(m).__name__ == "DSAAttention" and m.indexer is not None:
            m.indexer_loss = IndexerLossSwitch(SPARSE, 0.5) if indexer_loss else None
    memory = apply_memory_optimizations(model, opts)
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        with ops.policy("fused") as policy:
            hidden = model.model(tokens[:, :-1])
            from genolong.train.loss import chunked_lm_loss

            loss = chunked_lm_loss(hidden, model.lm_head.weight, tokens[:, 1:], tokens[:, 1:] >= 0, 4096)
        del hidden
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return loss.item(), grads, policy, peak
    finally:
        memory.remove()


@pytest.fixture(scope="module")
def setup():
    from genolong.model import GenoLongForCausalLM, get_preset

    kernels.load()
    torch.manual_seed(0)
    cfg = get_preset("glm53-mini", num_layers=8)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    tokens = torch.randint(0, 4, (1, T + 1), device=DEV)
    return cfg, model, tokens


@pytest.mark.parametrize("tile", [4096, 6144])  # 6144: an uneven last tile (16384 = 2 x 6144 + 4096)
@pytest.mark.parametrize("indexer_loss", [False, True])
def test_tiled_with_fused_kernels_equals_whole_layers(setup, tile, indexer_loss):
    from genolong.train.options import MemoryOptions

    cfg, model, tokens = setup
    whole_loss, whole_grad, _, whole_peak = _step(model, tokens, MemoryOptions(keep_sparse="off", moe_chunking=False), indexer_loss)
    loss, grad, policy, peak = _step(model, tokens, MemoryOptions(keep_sparse="off", tile_tokens=tile), indexer_loss)
    audit = policy.audit_summary()
    n_kda, n_dsa = sum(kind == "kda" for kind in cfg.layer_types), len(cfg.dsa_layers)
    assert audit["kda"] == {"fla_chunk_kda": n_kda} and audit["kda_short_conv"] == {"fla_causal_conv1d": n_kda}
    assert audit["dsa_sparse_attention"] == {"triton_sparse_mla": n_dsa}
    assert set(audit["dsa_indexer_topk"]) <= {"triton_fused_select", "triton_two_pass"}
    rel = ((grad - whole_grad).norm() / whole_grad.norm()).item()
    print(f"tile {tile}: loss {loss:.6f} whole {whole_loss:.6f}; gradients differ by {rel:.2e}; peak {peak / 2**30:.2f} vs {whole_peak / 2**30:.2f} GiB")
    assert abs(loss - whole_loss) <= 2e-3 * abs(whole_loss)
    assert rel <= 2e-2, rel


def test_tiles_with_offload_and_kept_results_from_pinned_memory(setup):
    from genolong.train.options import MemoryOptions

    _, model, tokens = setup
    whole_loss, whole_grad, _, _ = _step(model, tokens, MemoryOptions(keep_sparse="off", moe_chunking=False))
    loss, grad, policy, _ = _step(model, tokens, MemoryOptions(keep_sparse="host", offload_layers=8, tile_tokens=4096))
    rel = ((grad - whole_grad).norm() / whole_grad.norm()).item()
    assert abs(loss - whole_loss) <= 2e-3 * abs(whole_loss) and rel <= 2e-2, (loss, whole_loss, rel)


def test_the_tiled_backward_peak_is_lower_and_near_the_plan():
    """At 128k tokens a whole glm53-mini layer's working set (~12 GiB by the plan) dominates the
    peak of an 8-layer model; 16k tiles bound it to one tile's."""
    from genolong.model import GenoLongForCausalLM, get_preset
    from genolong.train.options import MemoryOptions
    from genolong.train.plan import estimate_memory

    kernels.load()
    torch.manual_seed(0)
    cfg = get_preset("glm53-mini", num_layers=8)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    seq = 1 << 17
    tokens = torch.randint(0, 4, (1, seq + 1), device=DEV)
    peaks, plans = {}, {}
    for tile in (None, 1 << 14):
        opts = MemoryOptions(keep_sparse="off", offload=False, moe_chunking=False, tile_tokens=tile)
        _, _, _, peaks[tile] = _step(model, tokens, opts)
        est = estimate_memory(cfg, seq, opts, 1, torch.cuda.get_device_properties(0).total_memory)
        plans[tile] = est.gpu_total - sum(v for k, v in est.gpu.items() if k in ("weights", "optimizer state"))
    print({t: (round(peaks[t] / 2**30, 2), round(plans[t] / 2**30, 2)) for t in peaks})
    assert peaks[1 << 14] < 0.6 * peaks[None]
