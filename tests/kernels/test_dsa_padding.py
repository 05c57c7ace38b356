"""Padding GLM's sparse attention to the TileLang kernel's shapes is neutral: checked on the CPU.

`emulated_backend()` computes what the kernels compute (576-wide q.k, values = first 512
columns, a slot is skipped only when it is -1, all-skipped rows give 0) in fp32; the padding,
query chunking and gradient accumulation of `sparse_attention` run unchanged on top of it.
"""

import pytest
import torch

from genolong.kernels import _common
from genolong.kernels.sparse_mla import tilelang as dsa
from genolong.model.dsa import sparse_attention_reference
from genolong.model.indexer import indexer_topk_reference


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def _case(seq, heads, kpool, topk_pools, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, 512, generator=g, dtype=torch.float64).float()
    kv = torch.randn(batch, seq, 512, generator=g, dtype=torch.float64).float()
    iq = torch.randn(batch, seq, 2, 16, generator=g)
    keys = torch.randn(batch, seq // kpool, 16, generator=g)
    w = torch.rand(batch, seq, 2, generator=g)
    idx = indexer_topk_reference(iq, keys, w, kpool=kpool, topk_pools=topk_pools, always_select_tail=True, softmax_scale=0.25)
    return q, kv, idx


def _grads(fn, q, kv, idx, dout):
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = fn(q, kv, idx)
    out.backward(dout)
    return out.detach(), q.grad, kv.grad


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "seq,heads,kpool,topk_pools,budget",
    [
        (300, 4, 4, 16, 1),  # W = 67 -> 128 slots; 2 query chunks of 256 (dkv summed over chunks)
        (40, 4, 4, 512, dsa.QUERY_BUDGET_BYTES),  # GLM's W = 2051 -> 2112; every query has < 2048 keys
        (97, 3, 1, 40, dsa.QUERY_BUDGET_BYTES),  # odd head count, no tail pool (kpool 1)
    ],
)
def test_padded_kernel_path_matches_reference_outputs_and_gradients(seq, heads, kpool, topk_pools, budget):
    q, kv, idx = _case(seq, heads, kpool, topk_pools, seed=seq)
    assert idx.shape[-1] % dsa.TOPK_MULTIPLE  # the width really needs padding
    assert ((idx >= 0).sum(-1) < idx.shape[-1]).any()  # early queries have fewer keys than slots
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    ref = _grads(lambda a, b, i: sparse_attention_reference(a, b, i, scale=0.05), q, kv, idx, dout)
    got = _grads(lambda a, b, i: dsa.sparse_attention(a, b, i, scale=0.05, backend=dsa.emulated_backend(), budget_bytes=budget),
                 q, kv, idx, dout)
    for name, r, x in zip(("out", "dq", "dkv"), ref, got):
        assert torch.isfinite(x).all(), name
        assert _rel(x, r) < 1e-5, (name, _rel(x, r))


def test_any_padding_index_but_minus_one_is_attended(monkeypatch):
    # The kernel skips only -1; padding with -2 would attend row 0, padding past the end a zero
    # row: either changes the output. This is why PAD_INDEX is -1 (and why the test can fail).
    q, kv, idx = _case(64, 4, 4, 8, seed=5)
    ref = sparse_attention_reference(q, kv, idx, scale=0.05)
    for bad in (-2, 10**6):
        monkeypatch.setattr(dsa, "PAD_INDEX", bad)
        got = dsa.sparse_attention(q, kv, idx, scale=0.05, backend=dsa.emulated_backend())
        assert _rel(got, ref) > 1e-3


def test_query_chunk_follows_the_budget():
    assert dsa.query_chunk(4, 2051) % dsa.SEQ_BUCKET == 0
    assert dsa.query_chunk(4, 2051, budget_bytes=1) == dsa.SEQ_BUCKET
    assert dsa.query_chunk(64, 2051) < dsa.query_chunk(4, 2051)


def test_unsupported_shapes_are_declined_with_a_reason():
    q, kv, idx = torch.zeros(1, 8, 4, 256, dtype=torch.bfloat16), torch.zeros(1, 8, 256, dtype=torch.bfloat16), torch.zeros(1, 8, 3, dtype=torch.int32)
    with pytest.raises(dsa.KernelUnsupported, match="512"):
        dsa.check_supported(q, kv, idx)
    with pytest.raises(dsa.KernelUnsupported, match="multiple of 64"):
        dsa.check_supported(torch.zeros(1, 8, 96, 512, dtype=torch.bfloat16), kv.new_zeros(1, 8, 512), idx)
    with pytest.raises(dsa.KernelUnsupported, match="bfloat16"):
        dsa.check_supported(q.new_zeros(1, 8, 4, 512).float(), kv.new_zeros(1, 8, 512), idx)
