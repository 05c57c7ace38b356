"""The kernel-policy registry: fused or fail loudly, and an audit of what ran."""

import pytest

from genolong.model import ops


@pytest.fixture
def op():
    name = "test_double"
    ops.register(name, ops.REFERENCE, lambda x: ("reference", 2 * x))
    yield name
    ops._STATE.impls.pop(name, None)
    ops.use("reference")


def test_reference_policy_runs_reference_even_when_fused_exists(op):
    ops.register(op, "fast", lambda x: ("fast", 2 * x))
    ops.reset_audit()
    with ops.policy("reference"):
        assert ops.call(op, 7, 3) == ("reference", 6)
    assert ops.audit() == {(7, op): "reference"}


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
    ops.reset_audit()
    with ops.policy("auto"):
        assert ops.call(op, 0, 2) == ("reference", 4)
    assert ops.audit_summary() == {op: {"reference": 1}}


def test_fused_policy_uses_fused_impl_and_audits_it(op):
    ops.register(op, "fast", lambda x: ("fast", 2 * x))
    ops.reset_audit()
    with ops.policy("fused"):
        assert ops.call(op, 1, 5) == ("fast", 10)
        assert ops.call(op, 2, 5) == ("fast", 10)
    assert ops.audit_summary() == {op: {"fast": 2}}


def test_unknown_policy_rejected():
    with pytest.raises(ValueError):
        ops.use("fastest")
