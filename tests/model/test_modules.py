"""Each hot op's reference against a naive formula, and the modules' contracts.

The references in genolong/model are the oracles the GPU kernels are tested against, so they are
themselves checked here against the plainest possible restatement of docs/ops.md: a brute-force
per-query indexer, dense attention under an explicit index mask, and a per-token expert loop
(the KDA recurrence: tests/model/test_kda.py).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset, ops
from genolong.model import dsa as dsa_mod
from genolong.model import indexer as indexer_mod
from genolong.model.dsa import DSAAttention, sparse_attention_reference
from genolong.model.indexer import Indexer, indexer_topk_reference
from genolong.model.mhc import HyperConnection
from genolong.model.mhc_math import sinkhorn
from genolong.model.moe import Router, moe_experts_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- indexer


def indexer_brute_force_scores(index_q, pool_keys, head_weights, *, kpool, softmax_scale):
    """score[b][t] = {selectable pool p: sum_h w[t,h] * relu(scale * q[t,h] . K[p])}, from docs/ops.md."""
    batch, seq = index_q.shape[:2]
    scores = []
    for b in range(batch):
        rows = []
        for t in range(seq):
            selectable = [p for p in range(pool_keys.shape[1]) if (p + 1) * kpool - 1 <= t]
            row = {}
            for p in selectable:
                dots = [(index_q[b, t, h].double() @ pool_keys[b, p].double()).item() for h in range(index_q.shape[2])]
                row[p] = sum(head_weights[b, t, h].item() * max(0.0, softmax_scale * d) for h, d in enumerate(dots))
            rows.append(row)
        scores.append(rows)
    return scores


@pytest.mark.parametrize(
    "seq,kpool,topk_pools,tail", [(45, 4, 3, True), (45, 4, 3, False), (30, 1, 5, True), (3, 4, 2, True), (20, 4, 8, True)]
)
def test_indexer_topk_matches_brute_force(seq, kpool, topk_pools, tail):
    gen = torch.Generator().manual_seed(1)
    heads, dim = 4, 8
    index_q = torch.randn(2, seq, heads, dim, generator=gen)
    pool_keys = torch.randn(2, seq // kpool, dim, generator=gen)
    head_weights = torch.randn(2, seq, heads, generator=gen)
    out = indexer_topk_reference(
        index_q, pool_keys, head_weights, kpool=kpool, topk_pools=topk_pools, always_select_tail=tail, softmax_scale=dim**-0.5
    )
    assert out.dtype == torch.int32
    assert out.shape == (2, seq, topk_pools * kpool + (kpool - 1 if tail else 0))
    scores = indexer_brute_force_scores(index_q, pool_keys, head_weights, kpool=kpool, softmax_scale=dim**-0.5)
    for b in range(2):
        for t in range(seq):
            row = out[b, t].tolist()
            got = [i for i in row if i >= 0]
            assert len(got) == len(set(got)), "duplicate key"
            assert all(i == -1 or 0 <= i <= t for i in row), "non-causal or bad slot"
            tail_tokens = set(range((t + 1) // kpool * kpool, t + 1)) if tail else set()
            assert tail_tokens <= set(got), (b, t, "tail")
            pool_tokens = set(got) - tail_tokens
            pools = {i // kpool for i in pool_tokens}
            assert pool_tokens == {p * kpool + j for p in pools for j in range(kpool)}, "partial pool"
            score = scores[b][t]
            assert len(pools) == min(topk_pools, len(score))
            rest = set(score) - pools
            # A valid top-k (ReLU makes exact ties common, so the set itself is not unique).
            if pools and rest:
                assert min(score[p] for p in pools) >= max(score[p] for p in rest) - 1e-5, (b, t)


def test_indexer_is_dense_causal_when_everything_fits():
    seq, kpool = 22, 4
    out = indexer_topk_reference(
        torch.randn(1, seq, 2, 8), torch.randn(1, seq // kpool, 8), torch.randn(1, seq, 2),
        kpool=kpool, topk_pools=8, always_select_tail=True, softmax_scale=1.0,
    )
    for t in range(seq):
        assert sorted(i for i in out[0, t].tolist() if i >= 0) == list(range(t + 1))


def test_indexer_query_chunking_changes_nothing(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    args = (
        torch.randn(1, 90, 4, 8, generator=gen),
        torch.randn(1, 22, 8, generator=gen),
        torch.randn(1, 90, 4, generator=gen),
    )
    kw = dict(kpool=4, topk_pools=3, always_select_tail=True, softmax_scale=0.3)
    whole = indexer_topk_reference(*args, **kw)
    monkeypatch.setattr(indexer_mod, "_SCORE_ELEMENTS", 4 * 22 * 7)  # 7 queries per chunk
    chunked = indexer_topk_reference(*args, **kw)
    assert torch.equal(whole.sort(-1).values, chunked.sort(-1).values)


def test_indexer_pool_keys_are_gated_per_channel_averages():
    cfg = get_preset("tiny").dsa.indexer
    torch.manual_seed(3)
    ix = Indexer(16, 12, cfg, layer_idx=0)
    with torch.no_grad():
        ix.index_kpool_compress_ape.normal_()
        ix.index_kpool_compress_gate.normal_(0, 0.3)
    x = torch.randn(2, 4 * 5 + 3, 16)
    pooled = ix.pool_keys(x)
    assert pooled.shape == (2, 5, cfg.head_dim)
    for p in range(5):
        tokens = x[:, 4 * p : 4 * p + 4]
        keys = ix.k_norm(ix.wk(tokens))
        w = (F.linear(tokens, ix.index_kpool_compress_gate) + ix.index_kpool_compress_ape).softmax(dim=1)
        assert torch.allclose(pooled[:, p], (w * keys).sum(1), atol=1e-6)


# ---------------------------------------------------------------- sparse attention


def _random_indices(batch, seq, width, gen):
    """Distinct causal indices per query, with -1 holes."""
    idx = torch.full((batch, seq, width), -1, dtype=torch.int32)
    for b in range(batch):
        for t in range(seq):
            n = int(torch.randint(1, min(width, t + 1) + 1, (1,), generator=gen))
            keys = torch.randperm(t + 1, generator=gen)[:n]
            slots = torch.randperm(width, generator=gen)[:n]
            idx[b, t, slots] = keys.int()
    return idx


def dense_masked_attention(q, kv, indices, scale):
    batch, seq = q.shape[:2]
    mask = torch.zeros(batch, seq, kv.shape[1], dtype=torch.bool)
    valid = indices >= 0
    b, t, j = valid.nonzero(as_tuple=True)
    mask[b, t, indices[b, t, j].long()] = True
    scores = torch.einsum("bthl,bsl->bths", q, kv) * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    return torch.einsum("bths,bsl->bthl", scores.softmax(-1), kv)


@pytest.mark.parametrize("dense_form", [False, True])
@pytest.mark.parametrize("gather_elements", [None, 7 * 8 * 16])
def test_sparse_attention_matches_masked_dense(monkeypatch, gather_elements, dense_form):
    """Both of the reference's formulations (gathered slots, dense scores with the selection as a
    mask), whole and chunked over queries, against a dense attention masked to the selection."""
    monkeypatch.setattr(dsa_mod, "_dense_is_cheaper", lambda *a: dense_form)
    if gather_elements is not None:
        monkeypatch.setattr(dsa_mod, "_GATHER_ELEMENTS", gather_elements)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 40, 3, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    indices = _random_indices(2, 40, 8, gen)
    out = sparse_attention_reference(q, kv, indices, scale=0.25)
    expected = dense_masked_attention(q, kv, indices, 0.25)
    assert _rel(out, expected) < 1e-12
    grads = torch.autograd.grad(out.sin().sum(), (q, kv))
    expected_grads = torch.autograd.grad(expected.sin().sum(), (q, kv))
    for got, want in zip(grads, expected_grads):
        assert _rel(got, want) < 1e-12


def _slotwise_attention(q, kv, indices, scale):
    """Query by query and head by head over the listed slots (a key listed twice counts twice)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            slots = [int(j) for j in indices[b, t] if j >= 0]
            if not slots:
                continue
            keys = kv[b, slots]  # [n, Dl]
            for h in range(q.shape[2]):
                scores = keys @ q[b, t, h] * scale
                out[b, t, h] = scores.softmax(0) @ keys
                lse[b, t, h] = scores.logsumexp(0)
    return out, lse


@pytest.mark.parametrize("dense_form", [False, True])
def test_sparse_attention_duplicate_slots_and_lse(monkeypatch, dense_form):
    """Duplicate and empty slots, and the log-sum-exp, alike in both formulations."""
    monkeypatch.setattr(dsa_mod, "_dense_is_cheaper", lambda *a: dense_form)
    monkeypatch.setattr(dsa_mod, "_GATHER_ELEMENTS", 5 * 6 * 8)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 9, 8, generator=gen, dtype=torch.float64)
    indices = torch.randint(-1, 9, (2, 9, 6), generator=gen, dtype=torch.int32)
    indices[0, 3] = torch.tensor([2, 2, 2, -1, 5, 5], dtype=torch.int32)
    indices[1, 4] = -1
    out, lse = sparse_attention_reference(q, kv, indices, scale=0.4, return_lse=True)
    want_out, want_lse = _slotwise_attention(q, kv, indices, 0.4)
    assert _rel(out, want_out) < 1e-12
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert (lse[finite] - want_lse[finite]).abs().max() < 1e-12
    assert out[1, 4].abs().max() == 0


def test_sparse_attention_picks_the_dense_form_only_for_wide_selections():
    q, kv = torch.zeros(1, 8, 4, 64), torch.zeros(1, 2048, 64)
    assert dsa_mod._dense_is_cheaper(q, kv, torch.zeros(1, 8, 2051, dtype=torch.int32))
    assert not dsa_mod._dense_is_cheaper(q, kv, torch.zeros(1, 8, 131, dtype=torch.int32))


def test_sparse_attention_row_without_keys_is_zero():
    indices = torch.full((1, 3, 4), -1, dtype=torch.int32)
    indices[0, 1, 0] = 0
    out = sparse_attention_reference(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 8), indices, scale=1.0)
    assert torch.isfinite(out).all()
    assert out[0, 0].abs().max() == 0 and out[0, 2].abs().max() == 0 and out[0, 1].abs().max() > 0


def test_dsa_absorbed_form_matches_expanded_mla():
    """The module's absorbed latent attention equals per-head MLA with expanded keys and values."""
    cfg = get_preset("tiny").dsa
    torch.manual_seed(5)
    attn = DSAAttention(24, cfg, 1e-5, layer_idx=0, has_indexer=True).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(2, 70, 24, dtype=torch.float64)
    out, topk = attn(x)
    assert (topk >= 0).sum(-1).max() <= cfg.indexer.width and (topk >= 0).sum(-1).min() < 70 - cfg.indexer.width

    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(2, 70, cfg.num_heads, cfg.qk_head_dim)
    kvx = attn.kv_b_proj(attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x))).view(2, 70, cfg.num_heads, -1)
    k, v = kvx.split([cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
    mask = torch.zeros(2, 70, 70, dtype=torch.bool)
    b, t, j = (topk >= 0).nonzero(as_tuple=True)
    mask[b, t, topk[b, t, j].long()] = True
    scores = torch.einsum("bthd,bshd->bhts", q, k) * cfg.qk_head_dim**-0.5
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    expected = attn.o_proj(torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 70, -1))
    assert _rel(out, expected) < 1e-10


# ---------------------------------------------------------------- MoE


def test_moe_experts_reference_matches_per_token_loop():
    gen = torch.Generator().manual_seed(6)
    n, d, inner, experts, k, limit = 50, 12, 10, 6, 3, 1.5
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inner, d, generator=gen, dtype=torch.float64)
    down = torch.randn(experts, d, inner, generator=gen, dtype=torch.float64)
    idx = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(n)])  # expert 5 unused
    w = torch.rand(n, k, generator=gen, dtype=torch.float64)
    y = moe_experts_reference(x, idx, w, gate_up, down, swiglu_limit=limit)
    for i in range(n):
        want = torch.zeros(d, dtype=torch.float64)
        for j in range(k):
            gate, up = (gate_up[idx[i, j]] @ x[i]).chunk(2)
            h = F.silu(torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))) * up.clamp(-limit, limit)
            want += w[i, j] * (down[idx[i, j]] @ h)
        assert torch.allclose(y[i], want, atol=1e-12)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_router_selects_by_biased_score_and_weights_by_unbiased(n_group, topk_group):
    cfg = get_preset("tiny", moe={"num_experts": 16, "top_k": 3, "n_group": n_group, "topk_group": topk_group}).moe
    torch.manual_seed(7)
    router = Router(8, cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(20, 8)
    idx, w = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    biased = scores + router.e_score_correction_bias
    for i in range(20):
        allowed = list(range(16))
        if n_group > 1:
            group_score = biased[i].view(n_group, -1).topk(2, dim=-1).values.sum(-1)
            groups = group_score.topk(topk_group).indices.tolist()
            allowed = [e for e in allowed if e // (16 // n_group) in groups]
        best = sorted(allowed, key=lambda e: -biased[i, e].item())[:3]
        assert sorted(idx[i].tolist()) == sorted(best)
        expected = scores[i, idx[i]] / scores[i, idx[i]].sum() * cfg.routed_scaling_factor
        assert torch.allclose(w[i], expected, atol=1e-6)
    assert w.dtype == torch.float32


# ---------------------------------------------------------------- mHC


def test_sinkhorn_makes_doubly_stochastic():
    comb = sinkhorn(torch.rand(5, 4, 4) + 0.01, iters=50, eps=0.0)
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-6)


def test_hyper_connection_matches_fp32_formula():
    cfg = get_preset("tiny").mhc
    torch.manual_seed(8)
    hc = HyperConnection(16, cfg, rms_eps=1e-5)
    with torch.no_grad():
        hc.fn.normal_(0, 0.5)
        hc.base.normal_()
        hc.scale.normal_()
    streams = torch.randn(2, 5, 4, 16)
    post, comb, collapsed = hc(streams)
    flat = streams.flatten(-2)
    logits = F.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-5), hc.fn)
    pre = torch.sigmoid(logits[..., :4] * hc.scale[0] + hc.base[:4]) + cfg.eps
    assert torch.allclose(post, 2 * torch.sigmoid(logits[..., 4:8] * hc.scale[1] + hc.base[4:8]), atol=1e-6)
    assert torch.allclose(collapsed, (pre.unsqueeze(-1) * streams).sum(-2), atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(2, 5, 4), atol=1e-5)


# ---------------------------------------------------------------- whole model contracts


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return GenoLongForCausalLM(get_preset("tiny"))


def test_gradients_reach_every_parameter_but_the_frozen_indexer(tiny_model):
    tiny_model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 5, (2, 160), generator=torch.Generator().manual_seed(9))
    tiny_model(ids).logits.logsumexp(-1).mean().backward()
    for name, p in tiny_model.named_parameters():
        if ".indexer." in name:
            assert p.grad is None, f"{name} got a gradient: the indexer is frozen"
        else:
            assert p.grad is not None and p.grad.abs().max() > 0, f"{name} got no gradient"


def test_fused_policy_on_cpu_fails_at_the_first_layer(tiny_model):
    # mHC mixes the streams before the mixer runs: it is the first hot op of every layer.
    ops.reset_audit()
    with ops.policy("fused"), pytest.raises(ops.KernelFallbackError, match="layer 0: op 'mhc_mix_collapse'"):
        tiny_model(torch.zeros(1, 16, dtype=torch.long))


def test_auto_policy_records_every_hot_op_per_layer(tiny_model):
    with ops.policy("auto") as auto, torch.no_grad():
        tiny_model(torch.zeros(1, 40, dtype=torch.long))
    cfg = tiny_model.config
    expected = {(i, op) for i in range(cfg.num_layers) if i not in cfg.dsa_layers for op in ("kda_short_conv", "kda")}
    expected |= {(i, op) for i in cfg.dsa_layers for op in ("dsa_indexer_topk", "dsa_sparse_attention")}
    expected |= {(i, "moe_experts") for i in cfg.moe_layers}
    expected |= {(i, op) for i in range(cfg.num_layers) for op in ("mhc_mix_collapse", "mhc_expand")}
    assert set(auto.audit) == expected
    assert set(auto.audit.values()) == {ops.REFERENCE}


def test_recompute_wraps_every_layer_and_keeps_gradients(tiny_model):
    from genolong.train.recompute import Recompute, apply_recompute
    from genolong.train.wrapper import unwrap

    ids = torch.randint(0, 5, (1, 96), generator=torch.Generator().manual_seed(10))

    def grads():
        tiny_model.zero_grad(set_to_none=True)
        tiny_model(ids).logits.square().mean().backward()
        return {n: p.grad.clone() for n, p in tiny_model.named_parameters() if p.grad is not None}

    plain = grads()
    wrappers = apply_recompute(tiny_model)
    try:
        recomputed = grads()
    finally:
        unwrap(tiny_model, Recompute)
    assert [w.calls for w in wrappers] == [1] * tiny_model.config.num_layers
    assert plain.keys() == recomputed.keys()
    for name in plain:
        assert torch.allclose(plain[name], recomputed[name], atol=1e-6, rtol=1e-5), name


def test_shared_indexer_layer_reuses_topk_through_the_wrappers():
    from genolong.train.recompute import apply_recompute

    cfg = get_preset(
        "tiny",
        num_layers=6,
        layer_types=["kda", "kda", "kda", "dsa", "dsa", "kda"],
        indexer_types=["full"] * 4 + ["shared", "full"],
    )
    torch.manual_seed(11)
    model = GenoLongForCausalLM(cfg)
    assert model.model.layers[4].self_attn.indexer is None
    assert model.model.layers[3].emits_topk and model.model.layers[4].reuses_topk
    used = {}
    for i in (3, 4):
        model.model.layers[i].self_attn.register_forward_hook(lambda m, a, o, i=i: used.__setitem__(i, o[1]))
    extras = {}
    for i, wrapper in enumerate(apply_recompute(model)):
        wrapper.register_forward_pre_hook(lambda m, args, i=i: extras.__setitem__(i, len(args) - 1))
    with torch.no_grad():
        model(torch.randint(0, 5, (1, 80)))
    assert torch.equal(used[3], used[4])
    assert extras == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 0}


def test_to_dtype_keeps_the_reference_fp32_parameters():
    torch.manual_seed(12)
    model = GenoLongForCausalLM(get_preset("tiny"), dtype=torch.bfloat16)
    fp32 = {n for n, p in model.state_dict().items() if p.dtype == torch.float32}
    assert "model.layers.3.mlp.gate.weight" in fp32
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in fp32
    assert "model.layers.0.self_attn.conv1d.weight" in fp32
    assert "model.layers.0.self_attn.forget_gate.A_log" in fp32
    assert "model.layers.0.attn_hc.base" in fp32 and "model.layers.0.ffn_hc.scale" in fp32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[3].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert model(torch.zeros(1, 8, dtype=torch.long)).logits.dtype == torch.bfloat16


def test_init_scales_output_projections_with_depth():
    cfg = get_preset("tiny", num_layers=8, hidden=128)
    torch.manual_seed(13)
    model = GenoLongForCausalLM(cfg)
    layer = model.model.layers[5]
    out_std = 0.02 / math.sqrt(16)
    assert abs(layer.self_attn.o_proj.weight.std().item() - out_std) < 0.15 * out_std
    assert abs(layer.mlp.experts.down_proj.std().item() - out_std) < 0.15 * out_std
    assert abs(layer.self_attn.q_proj.weight.std().item() - 0.02) < 0.15 * 0.02
    assert torch.equal(layer.attn_hc.base, torch.zeros_like(layer.attn_hc.base))
    g = layer.self_attn.forget_gate(torch.zeros(1, 1, 128))
    assert (g < 0).all() and (g > -0.6).all(), "initial per-step decay should be mild"


def test_validate_names_the_field_and_the_fix():
    with pytest.raises(GenolongError, match=r"dsa\.indexer\.topk \(30\).*set topk to 28"):
        get_preset("tiny", dsa={"indexer": {"topk": 30}})
    with pytest.raises(GenolongError, match=r"indexer_types\[3\] is 'shared'.*first DSA layer"):
        get_preset("tiny", indexer_types=["full", "full", "full", "shared"])
    with pytest.raises(GenolongError, match=r"mlp_types has 3 entries"):
        get_preset("tiny", mlp_types=["dense"] * 3)
    with pytest.raises(GenolongError, match=r"moe\.top_k"):
        get_preset("tiny", moe={"top_k": 9})
    with pytest.raises(GenolongError, match="unknown model preset"):
        get_preset("glm-6")
    with pytest.raises(GenolongError, match=r"unknown field kda\.heads"):
        get_preset("tiny", kda={"heads": 3})


def test_apply_overrides_changes_an_existing_config_and_keeps_the_weights_loadable():
    """A model trained with one indexer top-k runs with another: the config changes, the weights fit."""
    from genolong.model.presets import apply_overrides

    config = get_preset("tiny", dsa={"indexer": {"topk": 128}})
    sparse = apply_overrides(config, {"dsa": {"indexer": {"topk": 32}}})
    assert (config.dsa.indexer.topk, sparse.dsa.indexer.topk) == (128, 32)
    assert sparse.dsa.num_heads == config.dsa.num_heads and sparse.hidden == config.hidden
    torch.manual_seed(0)
    trained = GenoLongForCausalLM(config)
    moved = GenoLongForCausalLM(sparse)
    moved.load_state_dict(trained.state_dict())
    ids = torch.randint(0, 8, (1, 256))
    with torch.no_grad():
        assert torch.equal(trained(ids[:, :100]).logits[:, :32], moved(ids[:, :100]).logits[:, :32])  # both dense there
        assert not torch.allclose(trained(ids).logits[:, -1], moved(ids).logits[:, -1])  # 36 of 256 keys vs 132
    with pytest.raises(GenolongError, match=r"set topk to 28"):
        apply_overrides(config, {"dsa": {"indexer": {"topk": 30}}})
    with pytest.raises(GenolongError, match="num_layers"):
        apply_overrides(config, {"num_layers": 2})
    with pytest.raises(GenolongError, match="unknown model config field"):
        apply_overrides(config, {"width": 3})
