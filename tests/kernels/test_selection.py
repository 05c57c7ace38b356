"""Without CUDA: the kernels package imports, registers, declines CPU tensors, and the policy acts on that."""

import pytest
import torch

import genolong.kernels as kernels
from genolong.kernels import audit
from genolong.model import ops


@pytest.fixture(autouse=True)
def _restore_policy():
    previous = ops.current_policy()
    yield
    ops.use(previous)
    ops.reset_audit()


def _args(op):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "kda":
        return (r(1, 8, 2, 16), r(1, 8, 2, 16), r(1, 8, 2, 16), -torch.rand(1, 8, 2, 16, generator=g), torch.rand(1, 8, 2, generator=g)), {}
    if op == "dsa_sparse_attention":
        idx = torch.tril(torch.ones(8, 8, dtype=torch.int32)).cumsum(-1).sub(1).masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), -1)
        return (r(1, 8, 2, 512), r(1, 8, 512), idx[None]), {"scale": 0.1}
    if op == "kda_short_conv":
        return (r(1, 8, 6), r(6, 4)), {}
    if op == "dsa_indexer_topk":
        return (r(1, 16, 2, 32), r(1, 4, 32), r(1, 16, 2)), dict(kpool=4, topk_pools=2, always_select_tail=True, softmax_scale=0.2)
    if op == "dsa_indexer_loss":
        from genolong.model.dsa import sparse_attention_reference
        from genolong.model.indexer import indexer_topk_reference

        iq, pk, w, q, kv = r(1, 16, 2, 32), r(1, 4, 32), r(1, 16, 2), r(1, 16, 2, 64), r(1, 16, 64)
        idx = indexer_topk_reference(iq, pk, w, kpool=4, topk_pools=2, always_select_tail=True, softmax_scale=0.2)
        _, lse = sparse_attention_reference(q, kv, idx, scale=0.1, return_lse=True)
        return (iq, pk, w, q, kv, idx, lse), dict(kpool=4, topk_pools=2, index_scale=0.2, scale=0.1, grad_scale=1.0)
    if op == "mhc_mix_collapse":
        return (r(1, 5, 4, 16), r(24, 64), r(24), torch.ones(3)), dict(n=4, iters=20, eps=1e-6, rms_eps=1e-6)
    if op == "mhc_expand":
        return (torch.rand(1, 5, 4, generator=g), torch.rand(1, 5, 4, 4, generator=g), r(1, 5, 16), r(1, 5, 4, 16)), {}
    idx = torch.randint(0, 4, (6, 2), generator=g)
    return (r(6, 32), idx, torch.rand(6, 2, generator=g), r(4, 32, 32), r(4, 32, 16)), {"swiglu_limit": 10.0}


def test_load_registers_every_fused_implementation_next_to_the_reference():
    registered = kernels.load()
    for op, impls in kernels.FUSED.items():
        assert registered[op][0] == ops.REFERENCE
        assert [name for name, _, _ in impls] == [n for n in registered[op] if n != ops.REFERENCE]


@pytest.mark.parametrize("op", sorted(kernels.FUSED))
def test_fused_implementations_decline_cpu_tensors(op):
    kernels.load()
    args, kwargs = _args(op)
    for name, fn in ops.implementations(op).items():
        if name == ops.REFERENCE:
            continue
        with pytest.raises(ops.KernelUnsupported, match="CUDA"):
            fn(*args, **kwargs)


@pytest.mark.parametrize("op", sorted(kernels.FUSED))
def test_fused_policy_fails_loudly_and_auto_records_the_reference(op):
    kernels.load()
    args, kwargs = _args(op)
    ops.use("fused")
    with pytest.raises(ops.KernelFallbackError, match=rf"layer 7: op '{op}'.*CUDA"):
        ops.call(op, 7, *args, **kwargs)
    ops.use("auto")
    ops.reset_audit()
    ops.call(op, 7, *args, **kwargs)
    assert ops.audit() == {(7, op): ops.REFERENCE}


def test_audit_policy_choice_and_log_lines():
    assert audit.choose_policy("cuda") == "fused"
    assert audit.choose_policy("cpu") == "reference"
    assert audit.choose_policy("cuda", "reference") == "reference"
    with pytest.raises(ValueError):
        audit.choose_policy("cuda", "fast")
    assert audit.setup("cpu") == "reference"
    args, kwargs = _args("moe_experts")
    ops.call("moe_experts", 3, *args, **kwargs)
    assert audit.log_lines() == ["kernel policy: reference", "kernels moe_experts: reference x1"]


def test_available_reports_every_package():
    found = kernels.available()
    assert set(found) == {"triton", "tilelang", "flash-linear-attention", "megatron-core"}
