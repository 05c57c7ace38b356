"""The DSA indexer's KL loss: its references against per-query brute force, and what it trains.

The brute forces restate docs/model.md "Training the indexer" one query at a time in float64:
attention softmax over the query's selected keys (no lse), mass per selected pool summed over
heads, renormalised over the complete pools; indexer scores per pool; KL; gradients by autograd.
"""

import pytest
import torch
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.model import indexer_loss as il
from genolong.model.dsa import DSAAttention, sparse_attention_reference
from genolong.model.indexer import indexer_topk_reference
from genolong.model.indexer_loss import DENSE, SPARSE, IndexerLossSwitch, indexer_dense_loss, indexer_loss_reference
from genolong.model.indexer_recall import RecallProbe, sample_queries, selection_recall
from genolong.train.recompute import apply_recompute
from genolong.train.wrapper import unwrap


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _case(seq=41, batch=2, heads=3, latent=12, index_heads=2, index_dim=6, kpool=4, topk_pools=3, seed=0, tail=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, latent, generator=g, dtype=torch.float64)
    kv = torch.randn(batch, seq, latent, generator=g, dtype=torch.float64)
    iq = torch.randn(batch, seq, index_heads, index_dim, generator=g, dtype=torch.float64)
    pk = torch.randn(batch, seq // kpool, index_dim, generator=g, dtype=torch.float64)
    w = torch.randn(batch, seq, index_heads, generator=g, dtype=torch.float64)
    idx = indexer_topk_reference(iq, pk, w, kpool=kpool, topk_pools=topk_pools, always_select_tail=tail, softmax_scale=index_dim**-0.5)
    return q, kv, iq, pk, w, idx


def _brute_kl(q, kv, iq, pk, w, rows, *, scale, index_scale):
    """rows: per (b, t), (keys the attention sees, {pool: its keys}) -> summed KL (autograd-able)."""
    total = torch.zeros((), dtype=torch.float64)
    per_query = torch.zeros(q.shape[:2], dtype=torch.float64)
    for (b, t), (keys, pools) in rows.items():
        if not pools:
            continue
        probs = torch.softmax(scale * q[b, t] @ kv[b, keys].T, dim=-1)  # [H, n_keys]
        where = {k: i for i, k in enumerate(keys)}
        mass = torch.stack([probs[:, [where[k] for k in toks]].sum() for toks in pools.values()])
        target = mass / mass.sum()
        logits = torch.stack([(w[b, t] * F.relu(index_scale * iq[b, t] @ pk[b, p])).sum() for p in pools])
        kl = (target * (target.log() - logits.log_softmax(-1))).sum()
        per_query[b, t] = kl.detach()
        total = total + kl
    return total, per_query


def _sparse_rows(idx, kpool, topk_pools):
    rows = {}
    for b in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            row = idx[b, t].tolist()
            keys = [k for k in row if k >= 0]
            groups = [row[s * kpool : (s + 1) * kpool] for s in range(topk_pools)]
            rows[b, t] = (keys, {g[0] // kpool: g for g in groups if g[0] >= 0}) if keys else ([], {})
    return rows


def _brute(q, kv, iq, pk, w, rows, *, scale, index_scale, grad_scale):
    """(KL per query, gradients of grad_scale * their sum w.r.t. index_q, pool_keys, head_weights)."""
    leaves = [x.detach().clone().requires_grad_() for x in (iq, pk, w)]
    total, per_query = _brute_kl(q, kv, *leaves, rows, scale=scale, index_scale=index_scale)
    return per_query, torch.autograd.grad(total * grad_scale, leaves)


@pytest.mark.parametrize("kpool,topk_pools,tail", [(4, 3, True), (1, 7, False), (2, 30, True)])
def test_sparse_reference_matches_per_query_brute_force(monkeypatch, kpool, topk_pools, tail):
    q, kv, iq, pk, w, idx = _case(kpool=kpool, topk_pools=topk_pools, tail=tail)
    idx[1, 20] = -1  # a query with no key at all: lse -inf, no loss, no gradient
    scale, iscale, gs = 0.3, 0.4, 0.7
    out, lse = sparse_attention_reference(q, kv, idx, scale=scale, return_lse=True)
    monkeypatch.setattr(il, "_CHUNK_ELEMENTS", 1)  # one query per chunk
    kl, d_iq, d_pk, d_w = indexer_loss_reference(iq, pk, w, q, kv, idx, lse, kpool=kpool, topk_pools=topk_pools,
                                                 index_scale=iscale, scale=scale, grad_scale=gs)
    rows = _sparse_rows(idx, kpool, topk_pools)
    want, grads = _brute(q, kv, iq, pk, w, rows, scale=scale, index_scale=iscale, grad_scale=gs)
    assert _rel(kl, want) < 1e-10
    for got, exp in zip((d_iq, d_pk, d_w), grads):
        assert _rel(got, exp) < 1e-10
    assert kl[1, 20] == 0 and d_iq[1, 20].abs().max() == 0 and d_w[1, 20].abs().max() == 0
    assert (kl >= -1e-12).all() and kl[:, kpool * 2 :].abs().max() > 0


def test_dense_warmup_loss_matches_brute_force(monkeypatch):
    q, kv, iq, pk, w, _ = _case(seq=30, kpool=4)
    scale, iscale, gs = 0.3, 0.4, 1.3
    monkeypatch.setattr(il, "_CHUNK_ELEMENTS", 2 * 30 * 3 * 4)  # 4 queries per chunk
    kl, *got = indexer_dense_loss(iq, pk, w, q, kv, kpool=4, index_scale=iscale, scale=scale, grad_scale=gs)
    rows = {(b, t): (list(range(t + 1)), {p: list(range(4 * p, 4 * p + 4)) for p in range((t + 1) // 4)})
            for b in range(2) for t in range(30)}
    want, grads = _brute(q, kv, iq, pk, w, rows, scale=scale, index_scale=iscale, grad_scale=gs)
    assert _rel(kl, want) < 1e-10
    for a, b in zip(got, grads):
        assert _rel(a, b) < 1e-10


def test_sparse_and_dense_agree_when_every_pool_is_selected():
    # Short sequence: every complete pool is selected and the tail pool is the rest, so the sparse
    # attention is the dense one and both losses are the same per query.
    q, kv, iq, pk, w, idx = _case(seq=36, kpool=4, topk_pools=9)
    _, lse = sparse_attention_reference(q, kv, idx, scale=0.3, return_lse=True)
    kw = dict(kpool=4, index_scale=0.4, scale=0.3, grad_scale=1.0)
    sparse = indexer_loss_reference(iq, pk, w, q, kv, idx, lse, topk_pools=9, **kw)
    dense = indexer_dense_loss(iq, pk, w, q, kv, **kw)
    for a, b in zip(sparse, dense):
        assert _rel(a, b) < 1e-10


def test_sparse_attention_lse_is_the_natural_log_sum_exp_of_the_selection():
    q, kv, _, _, _, idx = _case(seq=25)
    idx[0, 7] = -1
    plain = sparse_attention_reference(q, kv, idx, scale=0.3)
    out, lse = sparse_attention_reference(q, kv, idx, scale=0.3, return_lse=True)
    assert torch.equal(out, plain) and lse.dtype == torch.float64 and not lse.requires_grad  # fp32, or wider inputs
    for b, t in [(0, 3), (1, 24), (0, 12)]:
        keys = idx[b, t][idx[b, t] >= 0].long()
        assert torch.allclose(lse[b, t].double(), torch.logsumexp(0.3 * q[b, t] @ kv[b, keys].T, -1), atol=1e-6)
    assert torch.isneginf(lse[0, 7]).all()


# ---------------------------------------------------------------- in the model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GenoLongForCausalLM(get_preset("tiny"))


def _step(model, ids, coeff, lm_scale=1.0, recompute=None, mode=SPARSE):
    """recompute: a list that receives the Recompute wrappers, whose layers then run checkpointed."""
    model.zero_grad(set_to_none=True)
    if recompute is not None:
        recompute.extend(apply_recompute(model))
    switch = IndexerLossSwitch(mode, coeff) if coeff is not None else None
    dsa = [layer.self_attn for layer in model.model.layers if layer.kind == "dsa"]
    for attn in dsa:
        attn.indexer_loss = switch
    try:
        logits = model(ids).logits
        (logits.logsumexp(-1).mean() * lm_scale).backward()
    finally:
        if recompute is not None:
            unwrap(model, type(recompute[0]))
        for attn in dsa:
            attn.indexer_loss = None
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), grads, switch


IDS = torch.randint(0, 5, (2, 160), generator=torch.Generator().manual_seed(9))


def test_the_kl_trains_the_indexer_and_changes_nothing_else(tiny):
    base_logits, base, _ = _step(tiny, IDS, None)
    logits, grads, switch = _step(tiny, IDS, 1.0)
    assert torch.equal(logits, base_logits)  # the loss is attached, the forward is unchanged
    indexer = [n for n in grads if ".indexer." in n]
    assert indexer and set(switch.values) == {3} and switch.values[3] > 0
    for name, g in grads.items():
        if ".indexer." in name:
            assert base[name] is None and g is not None and g.abs().max() > 0, name
        else:
            assert torch.equal(g, base[name]), f"{name}: the indexer loss changed a non-indexer gradient"


def test_the_lm_loss_does_not_reach_the_indexer(tiny):
    # Scaling by 2 is exact in floating point, so "2x" can be checked bit for bit.
    _, one, _ = _step(tiny, IDS, 1.0)
    _, lm2, _ = _step(tiny, IDS, 1.0, lm_scale=2.0)
    _, kl2, _ = _step(tiny, IDS, 2.0)
    for name in one:
        if ".indexer." in name:
            # The indexer's gradient is coeff x the KL's: independent of the LM loss, linear in coeff.
            assert torch.equal(lm2[name], one[name]), name
            assert torch.equal(kl2[name], 2 * one[name]), name
        else:
            assert torch.equal(lm2[name], 2 * one[name]), name
            assert torch.equal(kl2[name], one[name]), name


def test_recompute_computes_the_loss_once_with_the_same_gradients(tiny):
    _, plain, s1 = _step(tiny, IDS, 1.0)
    wrappers = []
    _, recomputed, s2 = _step(tiny, IDS, 1.0, recompute=wrappers)
    assert sum(w.calls for w in wrappers) == tiny.config.num_layers
    assert torch.equal(s1.values[3], s2.values[3])
    for name in plain:
        assert _rel(recomputed[name], plain[name]) < 1e-6, name


def _dsa_layer(seed=4):
    torch.manual_seed(seed)
    attn = DSAAttention(64, get_preset("tiny", dsa={"indexer": {"topk": 16}}).dsa, 1e-5, layer_idx=0, has_indexer=True).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return attn, torch.randn(2, 90, 64, dtype=torch.float64)


@pytest.mark.parametrize("query_chunk", [il.LOSS_QUERY_CHUNK, 7])
def test_the_layer_gradient_is_the_reference_kl_chained_through_the_indexer(monkeypatch, query_chunk):
    # What the layer's backward adds to the indexer equals coeff / (B*T) x the gradient of the
    # reference op's KL, taken through the indexer's projections by plain autograd; the backward
    # recomputes those projections in query chunks, which must not change anything.
    monkeypatch.setattr(il, "LOSS_QUERY_CHUNK", query_chunk)
    attn, x = _dsa_layer()
    attn.indexer_loss = IndexerLossSwitch(SPARSE, 0.5)
    attn(x)[0].sum().backward()
    got = {n: p.grad.clone() for n, p in attn.indexer.named_parameters()}
    kl_value = attn.indexer_loss.values[0]

    attn.zero_grad(set_to_none=True)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x)).detach()
    q = torch.einsum("bthd,hdl->bthl", attn.q_b_proj(q_resid).view(2, 90, -1, attn.qk_head_dim), attn.absorbed_weights()[0]).detach()
    latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)).detach()
    proj = attn.indexer.project(x, q_resid)
    topk = attn.indexer.select(proj)
    _, lse = sparse_attention_reference(q, latent, topk, scale=attn.scale, return_lse=True)
    cfg = attn.indexer.cfg
    kl, *grads = indexer_loss_reference(*proj, q, latent, topk, lse, kpool=cfg.kpool, topk_pools=cfg.topk_pools,
                                        index_scale=cfg.head_dim**-0.5, scale=attn.scale, grad_scale=0.5 / 180)
    torch.autograd.backward(list(proj), grads)
    assert abs(kl_value.item() / (kl.sum().item() / 180) - 1) < 1e-6  # logged in fp32
    for name, p in attn.indexer.named_parameters():
        assert _rel(got[name], p.grad) < 1e-10, name


def _old_sparse_loss_gradients(indexer, x, q_resid, q, kv, indices, lse, *, scale, grad_scale):
    """The sparse stage's backward as it was before --indexer-loss-queries existed (one process):
    every query, in chunks of LOSS_QUERY_CHUNK."""
    cfg, params = indexer.cfg, list(indexer.parameters())
    grads = [None] * len(params)

    def add(new):
        for i, g in enumerate(new):
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g

    with torch.enable_grad():
        pool_keys = indexer.pool_keys(x)
    d_pool_keys = torch.zeros(pool_keys.shape, dtype=il.wide(pool_keys.dtype))
    kl_sum = 0.0
    for t0 in range(0, q.shape[1], il.LOSS_QUERY_CHUNK):
        t1 = min(q.shape[1], t0 + il.LOSS_QUERY_CHUNK)
        with torch.enable_grad():
            index_q, head_weights = indexer.queries(x[:, t0:t1], q_resid[:, t0:t1])
        kl, d_iq, d_pk, d_w = indexer_loss_reference(
            index_q.detach(), pool_keys.detach(), head_weights.detach(), q[:, t0:t1], kv, indices[:, t0:t1], lse[:, t0:t1],
            kpool=cfg.kpool, topk_pools=cfg.topk_pools, index_scale=indexer.softmax_scale, scale=scale, grad_scale=grad_scale,
        )
        add(torch.autograd.grad((index_q, head_weights), params, (d_iq, d_w), allow_unused=True))
        d_pool_keys += d_pk
        kl_sum = kl_sum + kl.sum()
    add(torch.autograd.grad(pool_keys, params, d_pool_keys.to(pool_keys.dtype), allow_unused=True))
    return kl_sum, grads


@pytest.mark.parametrize("fraction", [1.0, 0.3])
def test_every_query_or_a_sequence_of_one_block_is_the_old_loss_bit_for_bit(monkeypatch, fraction):
    # fraction 1 scores every query; 90 queries are one block of 4096, so 0.3 scores them all too.
    monkeypatch.setattr(il, "LOSS_QUERY_CHUNK", 7)
    captured = []
    real = il.sparse_loss_gradients

    def spy(indexer, x, q_resid, q, kv, indices, lse, **kw):
        captured.append((indexer, x, q_resid, q, kv, indices, lse, kw["scale"]))
        return real(indexer, x, q_resid, q, kv, indices, lse, **kw)

    monkeypatch.setattr(il, "sparse_loss_gradients", spy)
    attn, x = _dsa_layer()
    attn.indexer_loss = IndexerLossSwitch(SPARSE, 0.5, weight=0.5, query_fraction=fraction, step=3)
    attn(x)[0].sum().backward()
    indexer, *tensors, scale = captured[0]
    kl_sum, grads = _old_sparse_loss_gradients(indexer, *tensors, scale=scale, grad_scale=0.5 * 0.5 / 180)
    assert torch.equal(attn.indexer_loss.values[0], kl_sum.float() * (0.5 / 180))
    for (name, p), g in zip(attn.indexer.named_parameters(), grads, strict=True):
        assert g is not None and torch.equal(p.grad, g), name


def _layer_tensors(attn, x):
    """What a DSA layer's forward hands its indexer loss: (q_resid, q, latent, top-k, lse), detached."""
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x)).detach()
    q = torch.einsum("bthd,hdl->bthl", attn.q_b_proj(q_resid).view(*x.shape[:2], -1, attn.qk_head_dim), attn.absorbed_weights()[0]).detach()
    latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)).detach()
    topk = attn.indexer.select(attn.indexer.project(x, q_resid))
    _, lse = sparse_attention_reference(q, latent, topk, scale=attn.scale, return_lse=True)
    return q_resid, q, latent, topk, lse


def test_a_piece_that_scores_no_query_returns_zero_gradients_for_every_parameter():
    # Pieces' gradients are summed over ranks: each must hold one for the same parameters.
    attn, x = _dsa_layer()
    tensors = _layer_tensors(attn, x)
    kw = dict(scale=attn.scale, grad_scale=0.1)
    kl_all, every = il.sparse_loss_gradients(attn.indexer, x, *tensors, **kw)
    kl_none, none = il.sparse_loss_gradients(attn.indexer, x, *tensors, rows=[], **kw)
    assert kl_all > 0 and kl_none == 0
    for g_all, g_none in zip(every, none, strict=True):
        assert (g_all is None) == (g_none is None)
        assert g_none is None or (g_none.shape == g_all.shape and not g_none.any())
    assert all(g is not None for g in every)


def _blocks_covered(blocks, block, length):
    """Query positions of the chosen blocks, by the documented rule: block b holds [b*block, min((b+1)*block, length))."""
    return torch.tensor([t for b in blocks for t in range(b * block, min((b + 1) * block, length))])


def test_a_subset_of_query_blocks_is_the_reference_on_those_queries_over_their_count():
    attn, x = _dsa_layer()
    block, fraction, coeff = 16, 0.5, 0.5  # 90 queries: 6 blocks, the last of 10; ceil(0.5 * 6) = 3 scored
    steps = {}
    for step in range(40):
        blocks = il.scored_blocks(90, fraction, block=block, seed=7, step=step, layer=0)
        steps.setdefault(5 in blocks, (step, blocks))
    for step, blocks in steps.values():  # with and without the short last block
        attn.zero_grad(set_to_none=True)
        attn.indexer_loss = IndexerLossSwitch(SPARSE, coeff, query_fraction=fraction, query_block=block, seed=7, step=step)
        attn(x)[0].sum().backward()
        got = {n: p.grad.clone() for n, p in attn.indexer.named_parameters()}
        kl_value = attn.indexer_loss.values[0]

        attn.zero_grad(set_to_none=True)
        rows = _blocks_covered(blocks, block, 90)
        assert len(blocks) == 3 and len(rows) == (42 if 5 in blocks else 48)
        q_resid, q, latent, topk, lse = _layer_tensors(attn, x)
        iq, pk, w = attn.indexer.project(x, q_resid)
        cfg = attn.indexer.cfg
        n_scored = 2 * len(rows)
        kl, d_iq, d_pk, d_w = indexer_loss_reference(
            iq[:, rows], pk, w[:, rows], q[:, rows], latent, topk[:, rows], lse[:, rows], kpool=cfg.kpool,
            topk_pools=cfg.topk_pools, index_scale=cfg.head_dim**-0.5, scale=attn.scale, grad_scale=coeff / n_scored,
        )
        full_iq, full_w = torch.zeros_like(iq), torch.zeros_like(w)
        full_iq[:, rows], full_w[:, rows] = d_iq, d_w
        torch.autograd.backward([iq, pk, w], [full_iq, d_pk, full_w])
        assert abs(kl_value.item() / (kl.sum().item() / n_scored) - 1) < 1e-6  # the mean over the scored queries
        for name, p in attn.indexer.named_parameters():
            assert _rel(got[name], p.grad) < 1e-10, name
    assert len(steps) == 2


def test_the_block_choice_is_a_function_of_seed_step_and_layer():
    def draw(**kw):
        return il.scored_blocks(**{"length": 512 * 1024, "fraction": 0.25, "block": 4096, "seed": 0, "step": 5, "layer": 3, **kw})

    blocks = draw()
    assert len(blocks) == 32 and blocks == sorted(set(blocks)) and 0 <= blocks[0] and blocks[-1] < 128
    assert draw() == blocks  # the same on every rank, piece and resume
    assert draw(step=6) != blocks and draw(layer=7) != blocks and draw(seed=1) != blocks
    assert draw(fraction=1.0) == list(range(128))
    assert il.scored_blocks(1000, 0.1, block=4096, seed=0, step=0, layer=0) == [0]  # shorter than a block: one block
    assert len(il.scored_blocks(30 * 16, 0.1, block=16, seed=0, step=0, layer=0)) == 3  # 0.1 * 30 rounds to 3, not 4
    assert len(il.scored_blocks(30 * 16, 0.11, block=16, seed=0, step=0, layer=0)) == 4  # ceil
    assert len(il.scored_blocks(10 * 16, 1e-6, block=16, seed=0, step=0, layer=0)) == 1  # at least one
    # Uniform over blocks: each one scored in ~a quarter of the steps (every block equally likely
    # is what makes the subset's gradient an unbiased estimate of the full one).
    counts = torch.zeros(16)
    for step in range(2000):
        counts[il.scored_blocks(16 * 64, 0.25, block=64, seed=0, step=step, layer=3)] += 1
    assert ((counts / 2000 - 0.25).abs() < 0.04).all(), counts


def test_dense_warmup_trains_only_the_indexer_in_a_no_grad_forward(tiny):
    tiny.zero_grad(set_to_none=True)
    switch = IndexerLossSwitch(DENSE, 1.0)
    attn = tiny.model.layers[3].self_attn
    attn.indexer_loss = switch
    try:
        with torch.no_grad():
            tiny(IDS)
        with pytest.raises(GenolongError, match="no_grad"):
            tiny(IDS)
    finally:
        attn.indexer_loss = None
    for name, p in tiny.named_parameters():
        assert (p.grad is not None) == (".indexer." in name), name
    assert switch.values[3] > 0


def test_the_indexer_learns_where_attention_looks():
    # A DSA layer with peaked attention (large random weights), main weights fixed: the dense
    # warm-up then the sparse loss, with Adam on the indexer only, must raise the share of dense
    # attention the selection keeps well above a random indexer's.
    torch.manual_seed(0)
    cfg = get_preset("tiny", dsa={"indexer": {"topk": 16}}).dsa
    attn = DSAAttention(64, cfg, 1e-5, layer_idx=0, has_indexer=True)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if ".indexer." not in f".{name}" and p.dim() > 1:
                p.normal_(0, 0.5)
    x = torch.randn(2, 256, 64)
    opt = torch.optim.Adam(attn.indexer.parameters(), lr=1e-2)
    kls, recalls = [], []
    for mode, steps in ((DENSE, 30), (SPARSE, 10)):
        for i in range(steps):
            switch = IndexerLossSwitch(mode, 1.0)
            attn.indexer_loss, attn.recall_probe = switch, RecallProbe(64)
            if mode == DENSE:
                with torch.no_grad():
                    attn(x)
                kls.append(float(switch.values[0]))
            else:
                attn(x)[0].sum().backward()
            recalls.append(attn.recall_probe.values[0])
            opt.step()
            opt.zero_grad()
            attn.zero_grad(set_to_none=True)
    assert kls[-1] < 0.5 * kls[0]
    assert recalls[0] < 0.3 and recalls[-1] > 0.75, (recalls[0], recalls[-1])


# ---------------------------------------------------------------- recall


def test_recall_is_the_dense_mass_on_the_selection():
    q, kv, _, _, _, idx = _case(seq=60, kpool=4, topk_pools=3)
    pos = torch.tensor([20, 33, 59])
    got = selection_recall(q, kv, idx, pos, scale=0.3, key_block=7)  # 9 blocks, the online softmax
    assert torch.allclose(got, selection_recall(q, kv, idx, pos, scale=0.3), atol=1e-6)
    for b in range(2):
        for i, t in enumerate(pos.tolist()):
            probs = torch.softmax(0.3 * q[b, t] @ kv[b, : t + 1].T, -1)
            keys = idx[b, t][idx[b, t] >= 0].long()
            assert abs(got[b, i].item() - probs[:, keys].sum(-1).mean().item()) < 1e-6
    everything = torch.arange(60).expand(2, 60, 60).masked_fill(torch.arange(60)[:, None] < torch.arange(60), -1)
    assert torch.allclose(selection_recall(q, kv, everything, pos, scale=0.3), torch.ones(2, 3, dtype=torch.float32))


def test_recall_samples_the_sparse_part_and_a_recompute_does_not_measure_again():
    assert sample_queries(1000, 100, 10).tolist() == [100, 200, 300, 400, 500, 599, 699, 799, 899, 999]
    assert sample_queries(50, 100, 256).tolist() == list(range(50))
    probe = RecallProbe(4)
    q, kv, _, _, _, idx = _case(seq=60, kpool=4, topk_pools=3)
    probe.measure(3, q, kv, idx, scale=0.3, width=15)
    first = probe.values[3]
    probe.measure(3, q * 0, kv, idx, scale=0.3, width=15)
    assert probe.values == {3: first} and 0 < first < 1
