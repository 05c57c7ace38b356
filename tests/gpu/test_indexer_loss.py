"""The fused indexer loss and the TileLang path's lse on a CUDA GPU, against the PyTorch references
(skipped without one). glm53-mini shapes: 4 attention heads x 512 latent, indexer 4 x 128,
kpool 4, 512 pools: queries with fewer and with more visible pools than selected ones."""

import pytest
import torch

import genolong.kernels as kernels
from genolong.kernels import _common
from genolong.model import get_preset, ops
from genolong.model.indexer_loss import IndexerLossSwitch, SPARSE

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    kernels.load()
    monkeypatch.setattr(_common, "POISON", True)
    torch.manual_seed(0)


def _rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def _inputs(seq, heads=4, latent=512, index_heads=4, index_dim=128, kpool=4, topk_pools=512):
    q = torch.randn(1, seq, heads, latent, device=DEV).bfloat16()
    kv = torch.randn(1, seq, latent, device=DEV).bfloat16()
    iq = (torch.randn(1, seq, index_heads, index_dim, device=DEV) * 0.3 + 1.0).bfloat16()
    pk = (torch.randn(1, seq // kpool, index_dim, device=DEV) * 0.3 + 1.0).bfloat16()
    w = torch.randn(1, seq, index_heads, device=DEV) * index_heads**-0.5
    idx = ops.implementations("dsa_indexer_topk")["reference"](
        iq, pk, w, kpool=kpool, topk_pools=topk_pools, always_select_tail=True, softmax_scale=index_dim**-0.5)
    idx[0, seq // 3] = -1  # a query without keys
    return q, kv, iq, pk, w, idx


def test_tilelang_lse_is_the_natural_log_sum_exp_of_the_reference():
    q, kv, _, _, _, idx = _inputs(4096)
    scale = 128**-0.5
    out, lse = ops.implementations("dsa_sparse_attention")["tilelang_sparse_mla"](q, kv, idx, scale=scale, return_lse=True)
    _, ref = ops.implementations("dsa_sparse_attention")["reference"](q.float(), kv.float(), idx, scale=scale, return_lse=True)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref)) and torch.isneginf(lse[0, 4096 // 3]).all()
    live = torch.isfinite(ref)
    assert (lse[live] - ref[live]).abs().max().item() < 5e-2


def test_fused_indexer_loss_matches_the_reference_values_and_gradients():
    seq = 8192
    q, kv, iq, pk, w, idx = _inputs(seq)
    scale = 128**-0.5
    _, lse = ops.implementations("dsa_sparse_attention")["reference"](q.float(), kv.float(), idx, scale=scale, return_lse=True)
    kw = dict(kpool=4, topk_pools=512, index_scale=128**-0.5, scale=scale, grad_scale=1.0 / seq)
    got = ops.implementations("dsa_indexer_loss")["triton_pool_kl"](iq, pk, w, q, kv, idx, lse, **kw)
    ref = ops.implementations("dsa_indexer_loss")["reference"](iq.float(), pk.float(), w, q.float(), kv.float(), idx, lse, **kw)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16 and got[3].dtype == torch.float32
    for label, a, b in zip(("kl", "d_index_q", "d_pool_keys", "d_head_weights"), got, ref):
        assert _rel(a, b) <= 1e-2, (label, _rel(a, b))
    assert got[0][0, seq // 3] == 0


def test_fused_policy_trains_the_indexer_in_a_model():
    from genolong.model.model import GenoLongForCausalLM

    cfg = get_preset("glm53-mini", num_layers=4)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    ops.use("fused")
    ops.reset_audit()
    attn = model.model.layers[3].self_attn
    attn.indexer_loss = IndexerLossSwitch(SPARSE, 1.0)
    try:
        tokens = torch.randint(0, cfg.vocab_size, (1, 8192), device=DEV)
        model(tokens).logits.float().logsumexp(-1).mean().backward()
    finally:
        attn.indexer_loss = None
        ops.use("reference")
    assert ops.audit()[(3, "dsa_indexer_loss")] == "triton_pool_kl"
    assert all(impl != ops.REFERENCE for impl in ops.audit().values()), ops.audit()
    for name, p in attn.indexer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_fused_policy_with_a_query_subset_scores_the_chosen_blocks_only(monkeypatch):
    # --indexer-loss-queries 0.5 on 4 blocks: the fused op sees exactly the 2 chosen blocks' queries,
    # and the recorded KL is the mean over them.
    from genolong.model import indexer_loss as il
    from genolong.model.model import GenoLongForCausalLM

    cfg = get_preset("glm53-mini", num_layers=4)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    real = ops.implementations("dsa_indexer_loss")["triton_pool_kl"]
    calls = []

    def spy(*args, **kw):
        out = real(*args, **kw)
        calls.append((args[3].shape[1], out[0].double().sum().item()))
        return out

    monkeypatch.setitem(ops._IMPLS["dsa_indexer_loss"], "triton_pool_kl", spy)
    seq = 4 * il.QUERY_BLOCK
    assert len(il.scored_blocks(seq, 0.5, block=il.QUERY_BLOCK, seed=0, step=1, layer=3)) == 2
    attn = model.model.layers[3].self_attn
    switch = IndexerLossSwitch(SPARSE, 1.0, query_fraction=0.5, step=1)
    attn.indexer_loss = switch
    ops.use("fused")
    try:
        tokens = torch.randint(0, cfg.vocab_size, (1, seq), device=DEV)
        model(tokens).logits.float().logsumexp(-1).mean().backward()
    finally:
        attn.indexer_loss = None
        ops.use("reference")
    scored = 2 * il.QUERY_BLOCK
    assert calls and sum(rows for rows, _ in calls) == scored
    assert abs(float(switch.values[3]) / (sum(kl for _, kl in calls) / scored) - 1) < 1e-4
    for name, p in attn.indexer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
