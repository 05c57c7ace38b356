"""The kernel-policy registry: fused or fail loudly, an audit of what ran, and policies scoped to a
context or a model (never process-global), also through the recompute inside backward."""

import threading

import pytest
import torch

from genolong.model import GenoLongForCausalLM, frames, get_preset, ops
from genolong.model.model import bind_kernel_policy


@pytest.fixture
def op():
    name = "test_double"
    ops.register(name, ops.REFERENCE, lambda x: ("reference", 2 * x))
    yield name
    ops.unregister(name)


def test_reference_policy_runs_reference_even_when_fused_exists(op):
    ops.register(op, "fast", lambda x: ("fast", 2 * x))
    with ops.policy("reference") as p:
        assert ops.call(op, 7, 3) == ("reference", 6)
    assert p.audit == {(7, op): "reference"}


def test_fused_policy_fails_loudly_when_no_fused_impl(op):
    with ops.policy("fused"), pytest.raises(ops.KernelFallbackError, match="layer 3.*test_double"):
        ops.call(op, 3, 1)


def test_fused_policy_reports_why_the_kernel_declined(op):
    def declines(x):
        raise ops.KernelUnsupported("top-k 2051 is not a multiple of 64")

    ops.register(op, "tilelang", declines)
    with ops.policy("fused"), pytest.raises(ops.KernelFallbackError, match="multiple of 64"):
        ops.call(op, 11, 1)


def test_auto_policy_falls_back_and_records_it(op):
    def declines(x):
        raise ops.KernelUnsupported("no CUDA")

    ops.register(op, "tilelang", declines)
    with ops.policy("auto") as p:
        assert ops.call(op, 0, 2) == ("reference", 4)
    assert p.audit_summary() == {op: {"reference": 1}}


def test_fused_policy_uses_fused_impl_and_audits_it(op):
    ops.register(op, "fast", lambda x: ("fast", 2 * x))
    with ops.policy("fused") as p:
        assert ops.call(op, 1, 5) == ("fast", 10)
        assert ops.call(op, 2, 5) == ("fast", 10)
    assert p.audit_summary() == {op: {"fast": 2}}


def test_unknown_policy_rejected():
    with pytest.raises(ValueError):
        ops.use("fastest")
    with pytest.raises(ValueError):
        ops.KernelPolicy("fastest")


def test_a_context_policy_is_not_seen_by_another_thread(op):
    ops.register(op, "fast", lambda x: ("fast", 2 * x))
    seen = []
    with ops.policy("fused"):
        worker = threading.Thread(target=lambda: seen.append(ops.call(op, 0, 1)))
        worker.start()
        worker.join()
        assert ops.call(op, 0, 1) == ("fast", 2)
    assert seen == [("reference", 2)]  # the other thread runs under its own (default) policy


def _counting_model():
    """The tiny model, whose KDA op gets a 'fast' implementation that counts its calls per thread."""
    torch.manual_seed(0)
    return GenoLongForCausalLM(get_preset("tiny"))


def test_two_models_with_their_own_policies_in_one_process():
    reference = ops.implementations("kda")[ops.REFERENCE]
    calls = []

    def fast(*args, **kwargs):
        calls.append(threading.get_ident())
        return reference(*args, **kwargs)

    ops.register("kda", "test_fast", fast)
    try:
        plain, fused = _counting_model(), _counting_model()
        bind_kernel_policy(plain, "reference")
        policy = bind_kernel_policy(fused, "fused")
        assert "kernel_policy=fused" in str(fused) and "kernel_policy=reference" in str(plain)
        ids = torch.randint(0, 5, (1, 32))
        with torch.no_grad():
            plain(ids)
        assert calls == []  # the reference model never ran the fast implementation
        # Under the fused model's own policy the KDA layers run "test_fast"; every other op has no
        # fused implementation here, so the fused policy fails loudly at the first of them (mHC's, before
        # the mixer), whatever the context's policy is.
        with ops.policy("reference"), pytest.raises(ops.KernelFallbackError, match="mhc_mix_collapse"):
            fused(ids)
        policy.name = "auto"
        with torch.no_grad():
            fused(ids)
        kda_layers = [i for i in range(fused.config.num_layers) if i not in fused.config.dsa_layers]
        assert len(calls) == len(kda_layers)
        assert {(i, "kda") for i in kda_layers} <= set(policy.audit) and policy.audit[(kda_layers[0], "kda")] == "test_fast"
    finally:
        ops.unregister("kda", "test_fast")


def test_the_recompute_in_backward_runs_under_the_forward_policy():
    """The layers' recompute happens inside backward (on CUDA, in autograd's own thread, where no
    context policy is set): it must run the implementation the forward ran."""
    from genolong.train.recompute import apply_recompute

    reference = ops.implementations("kda")[ops.REFERENCE]
    calls = []

    def fast(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return reference(*args, **kwargs)

    ops.register("kda", "test_fast", fast)
    try:
        model = _counting_model()
        apply_recompute(model)
        ids = torch.randint(0, 5, (1, 32))
        with ops.policy("auto"):
            loss = model(ids).logits.square().mean()
        forward_calls = len(calls)
        assert forward_calls > 0
        loss.backward()  # outside the context: only the recompute's captured policy can pick "test_fast"
        assert len(calls) == 2 * forward_calls
    finally:
        ops.unregister("kda", "test_fast")


@pytest.mark.parametrize("keep", [False, True])
def test_checkpointed_is_true_in_a_layer_checkpoints_forward_and_recompute_only(keep):
    """`frames.checkpointed()` tells an op it may save intermediates for a backward that follows at once;
    it must hold inside the checkpoint's forward and its recompute (with kept results or without), and
    nowhere else."""
    from genolong.train.keep import KeptResults
    from genolong.train.recompute import checkpointed

    seen = []

    def layer(x):
        seen.append(frames.checkpointed())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    assert not frames.checkpointed()
    out = checkpointed(layer, x, keep=KeptResults(where="device") if keep else None)
    assert seen == [True] and not frames.checkpointed()
    out.sum().backward()
    assert seen == [True, True] and not frames.checkpointed()
    torch.testing.assert_close(x.grad, x.detach().cos())
    layer(x)
    assert seen[-1] is False
