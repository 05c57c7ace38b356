"""The fused kernels against the model's PyTorch references on a CUDA GPU (skipped without one).

Outputs and gradients are compared by relative Frobenius error against references computed in
fp32 from the same bf16 inputs; wrapper-allocated outputs start as NaN / -7 (POISON), so an
element no kernel wrote fails the comparison.
"""

from collections import Counter

import pytest
import torch

import genolong.kernels as kernels
from genolong.kernels import _common
from genolong.model import ops

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


def _impl(op, name):
    return ops.implementations(op)[name]


def _indexer_inputs(seq, heads=4, dim=128, kpool=4):
    # Positive-mean q and keys: no relu zeros, so no tied scores and a unique top-k.
    q = (torch.randn(1, seq, heads, dim, device=DEV) * 0.3 + 1.0).bfloat16()
    keys = (torch.randn(1, seq // kpool, dim, device=DEV) * 0.3 + 1.0).bfloat16()
    w = torch.randn(1, seq, heads, device=DEV) * heads**-0.5
    return q, keys, w


def _sets(x):
    return [set(r) - {-1} for r in x[0].tolist()]


def _near_ties_only(got, ref, q, keys, w, kw, rel=1e-5):
    """Rows where the selections differ: every pool picked by one side only must score within
    `rel` of the row's top-k boundary (fp64 scores), i.e. differ only by fp32 rounding order.

    `rel` is relative to the size of what the kernels sum (sum_h |w_h| relu(q_h.k) at the pool
    and at the boundary), the scale of fp32 rounding: the score itself, sum_h w_h relu(q_h.k),
    can be near 0 where large terms of both signs cancel, and a tolerance relative to it then
    flags a rounding-order swap as a wrong selection (on the CPU, at 98k queries, rows with a
    boundary score of 0.08 differed by 7e-6 of it while 3e-8 of the terms' size)."""
    from genolong.kernels.indexer import topk as it

    # Rows whose sorted selections differ, found on the device; only those go through Python sets
    # (the sets of every row of a 12k x 2,051 selection take ~10 s each time they are built).
    maybe = (got[0].sort(-1).values != ref[0].sort(-1).values).any(-1).nonzero().flatten().tolist()
    got_sets, ref_sets = {i: set(got[0, i].tolist()) - {-1} for i in maybe}, {i: set(ref[0, i].tolist()) - {-1} for i in maybe}
    bad = [i for i in maybe if got_sets[i] != ref_sets[i]]
    # Every differing row is checked (not only up to the first failure), so that a failure says how
    # many rows, at which positions and how far from the boundary: a kernel bug past some length
    # and a tolerance too tight look different.
    far = []
    for i in bad:
        t = torch.tensor([i], device=DEV)
        row = dict(kpool=kw["kpool"], scale=kw["softmax_scale"])
        s = it.scores_torch(q[0, i : i + 1].double(), keys[0].double(), w[0, i : i + 1].double(), t, **row)[0]
        size = it.scores_torch(q[0, i : i + 1].double(), keys[0].double(), w[0, i : i + 1].double().abs(), t, **row)[0]
        top = s.topk(kw["topk_pools"])
        kth, kth_size = top.values[-1].item(), size[top.indices[-1]].item()
        diff = {x // kw["kpool"] for x in got_sets[i] ^ ref_sets[i]}
        worst = max(abs(s[p].item() - kth) / max(size[p].item(), kth_size, 1e-30) for p in diff)
        if worst > rel:
            far.append((i, worst, len(diff)))
    if far:
        by_64k = {f"{64 * b}k-{64 * (b + 1)}k": n for b, n in sorted(Counter(i // 65536 for i, _, _ in far).items())}
        worst = max(far, key=lambda f: f[1])
        raise AssertionError(
            f"{len(far)} of {len(bad)} differing rows (of {got.shape[1]}) differ beyond fp32 near-ties "
            f"(> {rel:g} of the summed terms' size); rows by position {by_64k}; first rows {[f[0] for f in far[:6]]}; "
            f"worst row {worst[0]}: {worst[2]} pool(s) differ, {worst[1]:.3g} of the terms' size from the boundary"
        )
    return len(bad)


@pytest.mark.parametrize("name", ["triton_two_pass", "torch_chunked"])
def test_indexer_selection_identical_to_reference(name):
    seq = 12288  # queries with fewer and with more than 512 visible pools
    q, keys, w = _indexer_inputs(seq)
    kw = dict(kpool=4, topk_pools=512, always_select_tail=True, softmax_scale=128**-0.5)
    ref = _impl("dsa_indexer_topk", "reference")(q, keys, w, **kw)
    if name == "torch_chunked":
        from genolong.kernels.indexer import topk as it

        got = it.dsa_indexer_topk_chunked(q, keys, w, **kw)
    else:
        got = _impl("dsa_indexer_topk", name)(q, keys, w, **kw)
    assert got.shape == ref.shape and got.dtype == torch.int32
    assert (got != _common.POISON_INT).all()
    # Continuous random scores sit ~1e-4 apart at the boundary, and cuBLAS sums in another order
    # than the kernels (~1e-7): a few rows may swap pools that are tied to fp32 rounding.
    mismatched = _near_ties_only(got, ref, q, keys, w, kw)
    assert mismatched <= seq // 20, f"{mismatched} of {seq} rows differ (all near-ties)"
    print(f"{name}: {mismatched} of {seq} rows differ from the reference, all within fp32 rounding of the boundary")


def test_indexer_fused_many_chunks_equals_one_chunk():
    from genolong.kernels.indexer import topk as it
    from genolong.kernels.indexer import triton_kernels as indexer_triton

    q, keys, w = _indexer_inputs(8192)
    kw = dict(kpool=4, topk_pools=256, always_select_tail=True, softmax_scale=128**-0.5,
              group_max=indexer_triton.group_max, candidate_scores=indexer_triton.candidate_scores)
    one = it.indexer_two_pass(q, keys, w, **kw)
    many = it.indexer_two_pass(q, keys, w, budget_bytes=1, **kw)  # 64-query chunks
    assert _sets(one) == _sets(many)


def test_dsa_sparse_attention_outputs_and_gradients(heads=4, seq=10240):
    # glm53-mini's 4 heads (the kernel computes 16: 12 padding heads). Every other head count
    # is a separate TileLang build of ~1.5 min, so only the model's is tested here.
    ref_fn = _impl("dsa_sparse_attention", "reference")
    q, keys, w = _indexer_inputs(seq)
    idx = _impl("dsa_indexer_topk", "reference")(q, keys, w, kpool=4, topk_pools=512, always_select_tail=True, softmax_scale=0.1)
    assert idx.shape[-1] == 2051 and ((idx >= 0).sum(-1) < 2048).any() and ((idx >= 0).sum(-1) >= 2048).any()
    qa = (torch.randn(1, seq, heads, 512, device=DEV)).bfloat16()
    kv = (torch.randn(1, seq, 512, device=DEV)).bfloat16()
    dout = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()
    scale = 128**-0.5

    def run(fn, dtype):
        a = qa.to(dtype).requires_grad_()
        b = kv.to(dtype).requires_grad_()
        out = fn(a, b, idx, scale=scale)
        out.backward(dout.to(dtype))
        return out, a.grad, b.grad

    ref = run(ref_fn, torch.float32)
    got = run(_impl("dsa_sparse_attention", "tilelang_sparse_mla"), torch.bfloat16)
    for label, g, r in zip(("out", "dq", "dkv"), got, ref):
        assert _rel(g, r) <= 1e-2, (label, _rel(g, r))


def test_kda_fla_outputs_and_gradients():
    b, t, h, d = 1, 1000, 4, 128
    q, k, v = (torch.randn(b, t, h, d, device=DEV).bfloat16() for _ in range(3))
    g = (-5 * torch.sigmoid(torch.randn(b, t, h, d, device=DEV))).float()
    beta = torch.rand(b, t, h, device=DEV).bfloat16()
    dout = torch.randn(b, t, h, d, device=DEV).bfloat16()

    def run(fn, dtype):
        # detach(): fresh leaves per run (g is fp32 already, so .to() alone would hand back g itself).
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
        out = fn(*leaves)
        out.backward(dout.to(dtype))
        return [out] + [x.grad for x in leaves]

    ref = run(_impl("kda", "reference"), torch.float32)
    got = run(_impl("kda", "fla_chunk_kda"), torch.bfloat16)
    for label, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref):
        assert _rel(x, r) <= 2e-2, (label, _rel(x, r))



def test_kda_backward_built_ahead_is_the_build_the_backward_uses():
    """genolong/kernels/kda/prebuild.py builds fla's TileLang KDA backward at one chunk of tokens; a
    backward at another length must find it (TileLang's sequence length is dynamic): fla's builder
    gains no entry. A key that differed would build again at the first backward, silently."""
    from genolong.kernels.kda import prebuild

    # 3 heads: a build no other test asks for, so the entry is this test's.
    shape = prebuild.KDABackwardShape(heads=3, key_dim=128, value_dim=128, dtype=torch.bfloat16)
    ahead = prebuild.KDABackwardPrebuild(shape, torch.device(DEV))
    ahead.wait()
    if ahead.outcome.startswith("skipped"):
        pytest.skip(ahead.outcome)
    assert ahead.outcome == "built", ahead.outcome
    from fla.ops.kda.backends.tilelang import chunk_bwd_dqkg

    cache = chunk_bwd_dqkg._build_kda_bwd_kernel._kernel_cache
    built = len(cache)
    b, t, h, d = 1, 3000, 3, 128
    leaves = [torch.randn(b, t, h, d, device=DEV).bfloat16().requires_grad_() for _ in range(3)]
    g = (-5 * torch.sigmoid(torch.randn(b, t, h, d, device=DEV))).float().requires_grad_()
    beta = torch.rand(b, t, h, device=DEV).bfloat16().requires_grad_()
    out = _impl("kda", "fla_chunk_kda")(*leaves, g, beta)
    out.float().square().sum().backward()
    assert torch.isfinite(leaves[0].grad.float()).all()
    assert len(cache) == built, "the backward built its TileLang kernel again: the ahead-of-time key differs"


@pytest.mark.parametrize("with_state", [False, True])
def test_kda_fla_keeping_intermediates_under_a_checkpoint_matches_fla_default(with_state):
    """Inside a layer checkpoint fla keeps its intermediates (disable_recompute); the gradients must be
    the ones fla's default (recompute in backward) gives, for the inputs and the state."""
    from genolong.kernels.kda import fla_chunk as mod
    from genolong.train.recompute import checkpointed

    b, t, h, d = 1, 1000, 4, 128
    q, k, v = (torch.randn(b, t, h, d, device=DEV).bfloat16() for _ in range(3))
    g = (-5 * torch.sigmoid(torch.randn(b, t, h, d, device=DEV))).float()
    beta = torch.rand(b, t, h, device=DEV).bfloat16()
    state = torch.randn(b, h, d, d, device=DEV) if with_state else None
    dout = torch.randn(b, t, h, d, device=DEV).bfloat16()
    seen = []

    def layer(*xs):
        seen.append(mod.keep_intermediates())
        if with_state:
            o, final = mod.kda_fla(*xs[:5], initial_state=xs[5], output_final_state=True)
            return o.float() + final.sum() * 1e-3  # the final state's gradient path too
        return mod.kda_fla(*xs)

    def run(checkpoint: bool):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta) + ((state,) if with_state else ())]
        out = checkpointed(layer, *leaves) if checkpoint else layer(*leaves)
        out.backward(dout.to(out.dtype))
        return [out] + [x.grad for x in leaves]

    plain = run(False)
    assert seen == [False]
    kept = run(True)
    assert seen[1:] == [True, True]  # the checkpoint's forward and its recompute
    for label, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dstate"), kept, plain):
        assert _rel(x, r) <= 1e-3, (label, _rel(x, r))

def test_moe_grouped_outputs_and_gradients():
    n, e, k, hidden, inter = 8192, 64, 4, 512, 256
    x = torch.randn(n, hidden, device=DEV).bfloat16()
    skew = torch.linspace(3, 0, e, device=DEV)
    idx = torch.topk(torch.randn(n, e, device=DEV) + skew, k).indices
    w = torch.rand(n, k, device=DEV)
    gu = (torch.randn(e, 2 * inter, hidden, device=DEV) * hidden**-0.5).bfloat16()
    dn = (torch.randn(e, hidden, inter, device=DEV) * inter**-0.5).bfloat16()
    dout = torch.randn(n, hidden, device=DEV).bfloat16()

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (x, gu, dn)]
        out = fn(leaves[0], idx, w, leaves[1], leaves[2], swiglu_limit=10.0)
        out.backward(dout.to(dtype))
        return [out] + [t.grad for t in leaves]

    ref = run(_impl("moe_experts", "reference"), torch.float32)
    got = run(_impl("moe_experts", "torch_grouped_mm"), torch.bfloat16)
    for label, a, r in zip(("y", "dx", "dgate_up", "ddown"), got, ref):
        assert _rel(a, r) <= 1e-2, (label, _rel(a, r))


def test_fused_policy_runs_only_fused_kernels_in_a_model():
    from genolong.kernels import audit
    from genolong.model import get_preset
    from genolong.model.model import GenoLongForCausalLM

    cfg = get_preset("glm53-mini", num_layers=4)
    model = GenoLongForCausalLM(cfg, dtype=torch.bfloat16).to(DEV)
    assert audit.setup("cuda") == "fused"
    tokens = torch.randint(0, cfg.vocab_size, (1, 8192), device=DEV)
    out = model(tokens)
    logits = getattr(out, "logits", out)
    logits.float().mean().backward()
    ran = ops.audit()
    assert ran and all(impl != ops.REFERENCE for impl in ran.values()), ran
    print("\n".join(audit.log_lines()))
