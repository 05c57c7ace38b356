"""The fla KDA wrapper's CPU-side behaviour: the op contract's keywords, and declining CPU tensors."""

import inspect

import pytest
import torch

import genolong.kernels as kernels
from genolong.model import ops


def test_every_kda_implementation_takes_the_state_keywords():
    kernels.load()
    for name, fn in ops.implementations("kda").items():
        params = inspect.signature(fn).parameters
        for keyword, default in (("initial_state", None), ("output_final_state", False)):
            assert keyword in params, (name, keyword)
            assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY and params[keyword].default is default, (name, keyword)


def test_kda_fla_declines_a_cpu_initial_state():
    from genolong.kernels.kda.fla_chunk import kda_fla

    q = torch.randn(1, 8, 2, 16)
    state = torch.zeros(1, 2, 16, 16)
    with pytest.raises(ops.KernelUnsupported, match="CUDA"):
        kda_fla(q, q, q, -torch.rand(1, 8, 2, 16), torch.rand(1, 8, 2), initial_state=state, output_final_state=True)


def _fake_fla(monkeypatch):
    """fla's chunk_kda replaced by a CPU stand-in that records its keywords (the wrapper's wiring only)."""
    import sys
    import types

    from genolong.kernels.kda import fla_chunk as mod

    calls = []

    def chunk_kda(q, k, v, g, beta, **kw):
        calls.append(kw)
        return (q * beta[..., None] + v) * torch.exp(g), None

    fake = types.ModuleType("fla.ops.kda")
    fake.chunk_kda = chunk_kda
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fake)
    monkeypatch.setattr(mod._common, "require_cuda", lambda *ts: None)
    return mod, calls


def test_kda_fla_keeps_intermediates_only_inside_a_checkpoint(monkeypatch):
    from genolong.train.recompute import checkpointed

    mod, calls = _fake_fla(monkeypatch)
    x = [torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3)]
    g = -torch.rand(1, 8, 2, 16)
    beta = torch.rand(1, 8, 2)

    mod.kda_fla(x[0], x[1], x[2], g, beta).sum().backward()
    assert [c["disable_recompute"] for c in calls] == [False]  # plain autograd: fla's default
    with torch.no_grad():
        mod.kda_fla(x[0], x[1], x[2], g, beta)
    assert calls[-1]["disable_recompute"] is False  # nothing is saved without grad
    checkpointed(lambda *t: mod.kda_fla(*t), x[0], x[1], x[2], g, beta).sum().backward()
    assert [c["disable_recompute"] for c in calls[2:]] == [True, True]  # the checkpoint's forward and recompute
