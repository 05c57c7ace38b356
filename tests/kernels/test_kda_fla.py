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
    from genolong.kernels.kda_fla import kda_fla

    q = torch.randn(1, 8, 2, 16)
    state = torch.zeros(1, 2, 16, 16)
    with pytest.raises(ops.KernelUnsupported, match="CUDA"):
        kda_fla(q, q, q, -torch.rand(1, 8, 2, 16), torch.rand(1, 8, 2), initial_state=state, output_final_state=True)
