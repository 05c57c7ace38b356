"""The few-head Triton sparse-MLA kernels against the fp32 reference on a CUDA GPU (skipped without one).

bf16 inputs, the indexer's pool-structured selections (W = 2051, early queries with fewer keys
than slots), every (forward, dkv) mode pair the benchmark times; out, dq and dkv by relative Frobenius error, lse absolute. Output
buffers start as NaN (POISON). The 1M-token case checks the 64-bit offsets: row * W and
row * H * D pass 2^31 there.
"""

import pytest
import torch

import genolong.kernels as kernels
from genolong.kernels import _common, sparse_mla
from genolong.model import ops
from genolong.model.dsa import sparse_attention_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
SCALE = 128**-0.5
# (forward mode, dkv mode): v1 with each dkv mode, the key-chunked forward, and the grouped passes.
MODES = [("query", "atomic"), ("query", "keychunk"), ("keychunk", "keychunk"), ("grouped", "grouped")]


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    kernels.load()
    monkeypatch.setattr(_common, "POISON", True)
    torch.manual_seed(0)


def _rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def _indexer_selection(seq):
    """The fused indexer's selection on random inputs (glm53-mini's indexer shape)."""
    q = (torch.randn(1, seq, 4, 128, device=DEV) * 0.3 + 1.0).bfloat16()
    keys = (torch.randn(1, seq // 4, 128, device=DEV) * 0.3 + 1.0).bfloat16()
    w = torch.randn(1, seq, 4, device=DEV) * 0.5
    impl = ops.implementations("dsa_indexer_topk")["triton_two_pass"]
    return impl(q, keys, w, kpool=4, topk_pools=512, always_select_tail=True, softmax_scale=128**-0.5)


def _lse_reference(q, kv, idx):
    out = []
    for c in range(0, idx.shape[1], 256):
        i = idx[:, c : c + 256].long()
        rows = kv[0][i[0].clamp(min=0)].float()  # [n, W, D]
        s = torch.einsum("nhd,nwd->nhw", q[0, c : c + 256].float(), rows) * SCALE
        out.append(s.masked_fill((i[0] < 0)[:, None], float("-inf")).logsumexp(-1))
    return torch.cat(out)[None]


@pytest.mark.parametrize("modes", MODES, ids=lambda m: "-".join(m))
@pytest.mark.parametrize("heads", [4, 16, 64])
def test_outputs_lse_and_gradients(heads, modes):
    fwd_mode, mode = modes
    seq = 4096
    idx = _indexer_selection(seq)
    assert idx.shape[-1] == 2051 and ((idx >= 0).sum(-1) < 2048).any() and ((idx >= 0).sum(-1) >= 2048).any()
    q = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()
    kv = torch.randn(1, seq, 512, device=DEV).bfloat16()
    dout = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()

    def run(fn, dtype):
        a, b = q.to(dtype).clone().requires_grad_(), kv.to(dtype).clone().requires_grad_()
        out = fn(a, b)
        out.backward(dout.to(dtype))
        return out, a.grad, b.grad

    ref = run(lambda a, b: sparse_attention_reference(a, b, idx, scale=SCALE), torch.float32)
    lse = {}

    def triton(a, b):
        out, lse["got"] = sparse_mla.sparse_mla(a, b, idx, scale=SCALE, return_lse=True, dkv_mode=mode, fwd_mode=fwd_mode,
                                                key_chunk=1024)
        return out

    got = run(triton, torch.bfloat16)
    errors = {label: _rel(g, r) for label, g, r in zip(("out", "dq", "dkv"), got, ref)}
    lse_err = (lse["got"] - _lse_reference(q, kv, idx)).abs().max().item()
    print(f"heads={heads} {fwd_mode}/{mode}: {errors}, lse max abs {lse_err:.2e}, configs {sparse_mla.chosen_configs()}")
    assert all(e <= 1e-2 for e in errors.values()), errors
    assert lse["got"].dtype == torch.float32 and lse_err <= 1e-2


def test_registered_first_and_returns_lse():
    names = [n for n in ops.implementations("dsa_sparse_attention") if n != ops.REFERENCE]
    assert names[:2] == ["triton_sparse_mla", "tilelang_sparse_mla"]
    q = torch.randn(1, 512, 4, 512, device=DEV).bfloat16()
    kv = torch.randn(1, 512, 512, device=DEV).bfloat16()
    idx = torch.randint(-1, 512, (1, 512, 64), device=DEV, dtype=torch.int32)
    idx[0, 7] = -1
    out, lse = ops.implementations("dsa_sparse_attention")["triton_sparse_mla"](q, kv, idx, scale=SCALE, return_lse=True)
    assert _rel(out, sparse_attention_reference(q.float(), kv.float(), idx, scale=SCALE)) <= 1e-2
    assert torch.isneginf(lse[0, 7]).all() and (out[0, 7] == 0).all()


@pytest.mark.parametrize("modes", MODES, ids=lambda m: "-".join(m))
def test_one_million_tokens_64_bit_offsets(modes):
    # Random pool-structured selections below each query (512 pools of 4, duplicates allowed);
    # the gradient flows from the last rows only, so the reference can run on those rows alone.
    seq, heads, tail = 1 << 20, 4, 64
    idx = torch.full((1, seq, 2051), -1, device=DEV, dtype=torch.int32)
    for t0 in range(0, seq, 1 << 17):
        visible = (torch.arange(t0, t0 + (1 << 17), device=DEV) + 1) // 4
        pools = (torch.rand(1 << 17, 512, device=DEV) * visible[:, None]).int()
        tokens = (pools[..., None] * 4 + torch.arange(4, device=DEV, dtype=torch.int32)).masked_fill((visible == 0)[:, None, None], -1)
        idx[0, t0 : t0 + (1 << 17), :2048].view(-1, 512, 4).copy_(tokens)
    q = torch.randn(1, seq, heads, 512, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(1, seq, 512, device=DEV, dtype=torch.bfloat16)
    dout = torch.zeros_like(q)
    dout[:, -tail:] = torch.randn(1, tail, heads, 512, device=DEV, dtype=torch.bfloat16)
    a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = sparse_mla.sparse_mla(a, b, idx, scale=SCALE, fwd_mode=modes[0], dkv_mode=modes[1])
    out.backward(dout)
    qa, kva = q[:, -tail:].float().requires_grad_(), kv.float().requires_grad_()
    ref = sparse_attention_reference(qa, kva, idx[:, -tail:], scale=SCALE)
    ref.backward(dout[:, -tail:].float())
    assert _rel(out[:, -tail:], ref) <= 1e-2
    assert _rel(a.grad[:, -tail:], qa.grad) <= 1e-2
    assert a.grad[:, :-tail].abs().max().item() == 0.0
    assert _rel(b.grad, kva.grad) <= 1e-2


@pytest.mark.parametrize("config", [(16, 64, 4, 1), (16, 64, 8, 2), (32, 64, 8, 1)], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("heads", [4, 16])
def test_slot_major_backward_matches_the_reference(heads, config):
    # Config.slot_major: the backward's products with the slots as rows (wgmma on sm_90),
    # through the key-chunked pass (several chunks) as a training step runs it.
    from genolong.kernels.sparse_mla_triton import Config

    seq = 4096
    idx = _indexer_selection(seq)
    q = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()
    kv = torch.randn(1, seq, 512, device=DEV).bfloat16()
    dout = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()
    grads = {}
    for label, dtype, fn in (("ref", torch.float32, lambda a, b: sparse_attention_reference(a, b, idx, scale=SCALE)),
                             ("slots", torch.bfloat16, lambda a, b: sparse_mla.sparse_mla(
                                 a, b, idx, scale=SCALE, key_chunk=1024, configs={"bwd": Config(*config, slot_major=True)}))):
        a, b = q.to(dtype).clone().requires_grad_(), kv.to(dtype).clone().requires_grad_()
        fn(a, b).backward(dout.to(dtype))
        grads[label] = (a.grad, b.grad)
    errors = {label: _rel(g, r) for label, g, r in zip(("dq", "dkv"), grads["slots"], grads["ref"])}
    print(f"slot-major heads={heads} {config}: {errors}")
    assert all(e <= 1e-2 for e in errors.values()), errors


# (heads, forward config, backward config): the products split over the latent columns
# (Config.split_k) at the few-head shapes the benchmark times, and one 64-head block.
SPLIT_CASES = [(4, (16, 32, 8, 5, 8), (16, 16, 4, 5, 4)), (4, (16, 32, 4, 5, 4), (16, 16, 4, 5, 1)),
               (16, (16, 32, 8, 5, 8), (16, 16, 8, 5, 8)), (64, (32, 16, 8, 5, 8), (32, 16, 8, 5, 8))]


@pytest.mark.parametrize("adds", ["coalesced", "layout"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}h-" + "x".join(map(str, c[1])) + "-" + "x".join(map(str, c[2])))
def test_split_products_and_layout_adds_match_the_reference(case, adds, monkeypatch):
    # The split score products and the fp32 adds from the products' own layout (GENOLONG_SPARSE_MLA_ADDS),
    # through the key-chunked backward (several chunks: the dq partial sums are added too).
    from genolong.kernels.sparse_mla_triton import Config

    heads, fwd, bwd = case
    monkeypatch.setenv(sparse_mla.ENV_RED, adds)
    seq = 4096
    idx = _indexer_selection(seq)
    q = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()
    kv = torch.randn(1, seq, 512, device=DEV).bfloat16()
    dout = torch.randn(1, seq, heads, 512, device=DEV).bfloat16()
    configs = {"fwd": Config(*fwd[:4], split_k=fwd[4]), "bwd": Config(*bwd[:4], split_k=bwd[4])}
    results = {}
    for label, dtype, fn in (("ref", torch.float32, lambda a, b: sparse_attention_reference(a, b, idx, scale=SCALE)),
                             ("triton", torch.bfloat16, lambda a, b: sparse_mla.sparse_mla(
                                 a, b, idx, scale=SCALE, key_chunk=1024, configs=configs))):
        a, b = q.to(dtype).clone().requires_grad_(), kv.to(dtype).clone().requires_grad_()
        out = fn(a, b)
        out.backward(dout.to(dtype))
        results[label] = (out, a.grad, b.grad)
    errors = {name: _rel(got, ref) for name, got, ref in zip(("out", "dq", "dkv"), results["triton"], results["ref"])}
    print(f"split {case} adds={adds}: {errors}")
    assert all(e <= 1e-2 for e in errors.values()), errors
