"""The fused indexer loss (Triton, in its CPU interpreter) and the TileLang path's lse, against the
model's references."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from genolong.kernels import _common
from genolong.kernels.sparse_mla import tilelang as dsa
from genolong.kernels.indexer import loss as fused
from genolong.model.dsa import sparse_attention_reference
from genolong.model.indexer import indexer_topk_reference
from genolong.model.indexer_loss import LOSS_QUERY_CHUNK

_INTERPRETED = r"""
import torch
from genolong.kernels import _common
from genolong.kernels.indexer import loss as fused
from genolong.model.dsa import sparse_attention_reference
from genolong.model.indexer import indexer_topk_reference
from genolong.model.indexer_loss import indexer_loss_reference
_common.POISON = True  # every output the kernels leave unwritten is NaN

def case(seq, batch, heads, latent, ih, idim, kpool, topk, dtype, tail=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, latent, generator=g)
    kv = torch.randn(batch, seq, latent, generator=g)
    iq = torch.randn(batch, seq, ih, idim, generator=g)
    pk = torch.randn(batch, seq // kpool, idim, generator=g)
    w = torch.randn(batch, seq, ih, generator=g)
    idx = indexer_topk_reference(iq, pk, w, kpool=kpool, topk_pools=topk, always_select_tail=tail, softmax_scale=idim**-0.5)
    idx[-1, seq // 2] = -1  # a query with no key: lse -inf
    q, kv, iq, pk = (x.to(dtype) for x in (q, kv, iq, pk))
    _, lse = sparse_attention_reference(q.float(), kv.float(), idx, scale=latent**-0.5, return_lse=True)
    return (iq, pk, w, q, kv, idx, lse), dict(kpool=kpool, topk_pools=topk, index_scale=idim**-0.5, scale=latent**-0.5, grad_scale=0.37)

CASES = {
    # odd head counts and widths (masked loads), 8 pools = 32 slots < one 64-slot block, W = 35,
    # queries without a complete pool, an empty row, two query chunks per batch row
    "kpool4": (dict(seq=72, batch=2, heads=3, latent=48, ih=2, idim=24, kpool=4, topk=8, dtype=torch.float32), 36 * 6 * 4 * 8),
    # 70 pools: two pool blocks, the second partial; no tail pool
    "kpool1": (dict(seq=80, batch=1, heads=2, latent=32, ih=3, idim=16, kpool=1, topk=70, dtype=torch.float32, tail=False), 1 << 30),
    # half-precision inputs as on the GPU (the interpreter has no bf16)
    "fp16": (dict(seq=44, batch=1, heads=4, latent=64, ih=4, idim=32, kpool=2, topk=10, dtype=torch.float16), 1 << 30),
}
for name, (kw, budget) in CASES.items():
    args, opts = case(**kw)
    ref = indexer_loss_reference(*[a.float() if a.is_floating_point() else a for a in args], **opts)
    got = fused.indexer_loss(*args, **opts, budget_bytes=budget)
    errs = []
    for label, r, x in zip(("kl", "d_index_q", "d_pool_keys", "d_head_weights"), ref, got):
        assert x.shape == r.shape and x.dtype == (args[0].dtype if label == "d_index_q" else args[1].dtype if label == "d_pool_keys" else torch.float32), (name, label, x.dtype)
        finite = bool(torch.isfinite(x).all())
        errs.append(f"{label}={((x.float() - r.float()).norm() / r.float().norm()).item() if finite else float('nan'):.2e}")
    print("CASE", name, *errs)
"""


@pytest.mark.slow(seconds=25)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_in_the_interpreter_match_the_reference_values_and_gradients():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("CASE")]
    assert len(lines) == 3, run.stdout + run.stderr[-3000:]
    for _, name, *errs in lines:
        bound = 2e-3 if name == "fp16" else 1e-5  # fp16 inputs: the reference reads the same rounded values in fp32
        for err in errs:
            label, value = err.split("=")
            assert float(value) < bound, (name, label, value)


def _attention_case(seq, heads, kpool, topk_pools, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads, 512, generator=g)
    kv = torch.randn(1, seq, 512, generator=g)
    iq, keys, w = torch.randn(1, seq, 2, 16, generator=g), torch.randn(1, seq // kpool, 16, generator=g), torch.rand(1, seq, 2, generator=g)
    idx = indexer_topk_reference(iq, keys, w, kpool=kpool, topk_pools=topk_pools, always_select_tail=True, softmax_scale=0.25)
    idx[0, 9] = -1
    return q, kv, idx


def test_tilelang_path_returns_the_natural_lse_and_minus_inf_for_empty_rows(monkeypatch):
    # The emulated backend computes the kernels' base-2 lse (0 for an empty row), as their source does.
    monkeypatch.setattr(_common, "POISON", True)
    q, kv, idx = _attention_case(300, 4, 4, 16, seed=3)
    ref_out, ref_lse = sparse_attention_reference(q, kv, idx, scale=0.05, return_lse=True)
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = dsa.sparse_attention(qa, kva, idx, scale=0.05, backend=dsa.emulated_backend(), budget_bytes=1, return_lse=True)
    assert not lse.requires_grad and lse.dtype == torch.float32
    assert torch.isneginf(lse[0, 9]).all() and torch.isneginf(ref_lse[0, 9]).all()
    live = torch.isfinite(ref_lse)
    assert (lse[live] - ref_lse[live]).abs().max() < 1e-5
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    plain_q, plain_kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    dsa.sparse_attention(plain_q, plain_kv, idx, scale=0.05, backend=dsa.emulated_backend(), budget_bytes=1).backward(dout)
    # Asking for the lse must not change the gradients (equal up to the summation order of the
    # multi-threaded scatter-adds into dkv). 1e-5: a few ulps of fp32 sums over ~100 terms; a real
    # change of the gradients by the lse path would be orders of magnitude larger.
    torch.testing.assert_close(qa.grad, plain_q.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kva.grad, plain_kv.grad, rtol=1e-5, atol=1e-5)
    assert (out - ref_out).abs().max() < 1e-4


def test_unsupported_inputs_are_declined_with_a_reason():
    kw = dict(kpool=4, topk_pools=2)
    iq, pk, w = torch.zeros(1, 8, 2, 16), torch.zeros(1, 2, 16), torch.zeros(1, 8, 2)
    q, kv, idx, lse = torch.zeros(1, 8, 2, 32), torch.zeros(1, 8, 32), torch.zeros(1, 8, 11, dtype=torch.int32), torch.zeros(1, 8, 2)
    fused.check_supported(iq, pk, w, q, kv, idx, lse, **kw)
    with pytest.raises(fused.KernelUnsupported, match="kpool must divide"):
        fused.check_supported(iq, pk, w, q, kv, idx, lse, kpool=3, topk_pools=2)
    with pytest.raises(fused.KernelUnsupported, match="fewer than"):
        fused.check_supported(iq, pk, w, q, kv, idx[..., :7], lse, **kw)
    with pytest.raises(fused.KernelUnsupported, match="int32"):
        fused.check_supported(iq, pk, w, q, kv, idx.long(), lse, **kw)
    with pytest.raises(fused.KernelUnsupported, match="share a dtype"):
        fused.check_supported(iq, pk, w, q.half(), kv, idx, lse, **kw)
    with pytest.raises(fused.KernelUnsupported, match="CUDA"):
        fused.dsa_indexer_loss_fused(iq, pk, w, q, kv, idx, lse, **kw, index_scale=1.0, scale=1.0, grad_scale=1.0)


def test_query_chunks_follow_the_budget_not_the_length():
    assert fused.chunk_rows(512) * 6 * 4 * 512 <= fused.BUDGET_BYTES
    # The layer's backward calls the op for LOSS_QUERY_CHUNK queries at a time: one kernel chunk each.
    assert fused.chunk_rows(512) >= LOSS_QUERY_CHUNK
    assert fused.chunk_rows(512, budget_bytes=1) == 16


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("shape", [(4, 512, 4, 128), (64, 512, 32, 128)], ids=["glm53-mini", "glm-5.3-flash"])
def test_triton_kernels_compile_for_sm90_without_spills(shape):
    # The interpreter runs the kernels' logic; lowering for Hopper (dot shapes, bf16, atomics) is
    # only checked by a real compile, which needs no GPU.
    from genolong.kernels.indexer import loss_triton as indexer_loss_triton

    from genolong.kernels import aot

    kernels = indexer_loss_triton.aot_compile(*shape, kpool=4, topk_pools=512)
    for name, kernel in kernels.items():
        ptx = kernel.asm["ptx"]
        assert "mma" in ptx, f"{name}: the products do not run on tensor cores"
        assert ".local" not in ptx, f"{name}: registers spill to local memory"
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, f"{name}: {kernel.metadata.shared} bytes of shared memory"
    assert "atom" in kernels["index_backward"].asm["ptx"]
