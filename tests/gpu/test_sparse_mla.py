"""The few-head Triton sparse-MLA kernels against the fp32 reference on a CUDA GPU (skipped without one).

bf16 inputs, the indexer's pool-structured selections (W = 2051, early queries with fewer keys
than slots), the backward in one pass and key chunk by key chunk; out, dq and dkv by relative Frobenius error, lse absolute. Output
buffers start as NaN (POISON). The 1M-token case checks the 64-bit offsets: row * W and
row * H * D pass 2^31 there.
"""

import pytest
import torch

import genolong.kernels as kernels
from genolong.kernels import _common
from genolong.kernels.sparse_mla import op as sparse_mla
from genolong.model import ops
from genolong.model.dsa import sparse_attention_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
SCALE = 128**-0.5
# Keys per chunk of the backward: None is one pass (a chunk as long as the sequence), else key chunks.
KEY_CHUNKS = [None, 1024]


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


@pytest.mark.parametrize("key_chunk", KEY_CHUNKS, ids=lambda c: "one-pass" if c is None else f"chunks-{c}")
@pytest.mark.parametrize("heads", [4, 16, 64])
def test_outputs_lse_and_gradients(heads, key_chunk):
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
        out, lse["got"] = sparse_mla.sparse_mla(a, b, idx, scale=SCALE, return_lse=True, key_chunk=key_chunk or seq)
        return out

    got = run(triton, torch.bfloat16)
    errors = {label: _rel(g, r) for label, g, r in zip(("out", "dq", "dkv"), got, ref)}
    lse_err = (lse["got"] - _lse_reference(q, kv, idx)).abs().max().item()
    print(f"heads={heads} key_chunk={key_chunk}: {errors}, lse max abs {lse_err:.2e}, configs {sparse_mla.chosen_configs()}")
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


@pytest.mark.xdist_group("gpu_memory")  # 1M tokens: never beside another large test on the shared GPU
@pytest.mark.parametrize("key_chunk", [None, sparse_mla.KEY_CHUNK], ids=lambda c: "one-pass" if c is None else f"chunks-{c}")
def test_one_million_tokens_64_bit_offsets(key_chunk):
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
    out = sparse_mla.sparse_mla(a, b, idx, scale=SCALE, key_chunk=key_chunk or seq)
    out.backward(dout)
    qa, kva = q[:, -tail:].float().requires_grad_(), kv.float().requires_grad_()
    ref = sparse_attention_reference(qa, kva, idx[:, -tail:], scale=SCALE)
    ref.backward(dout[:, -tail:].float())
    assert _rel(out[:, -tail:], ref) <= 1e-2
    assert _rel(a.grad[:, -tail:], qa.grad) <= 1e-2
    assert a.grad[:, :-tail].abs().max().item() == 0.0
    assert _rel(b.grad, kva.grad) <= 1e-2
