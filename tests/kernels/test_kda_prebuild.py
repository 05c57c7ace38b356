"""The KDA backward's ahead-of-time build (genolong/kernels/kda/prebuild.py) on the CPU: which build a
run asks for, the call it makes (shapes and dtypes fla's TileLang entry takes), and that a failure
or a missing fla never reaches the run. tests/gpu/test_kernels.py checks on the GPU that the build
is the one the real backward uses."""

import dataclasses

import torch

from genolong.kernels.kda import prebuild
from genolong.model.presets import get_preset


def test_the_shape_is_the_ranks_kda_heads_and_head_dims():
    mini = get_preset("glm53-mini")  # 4 KDA heads of 128
    assert prebuild.shape_for(mini, dtype=torch.bfloat16) == prebuild.KDABackwardShape(4, 128, 128, torch.bfloat16)
    # tp splits the heads: the kernel's head count is fixed at build time.
    assert prebuild.shape_for(mini, dtype=torch.bfloat16, tp=2) == prebuild.KDABackwardShape(2, 128, 128, torch.bfloat16)
    assert prebuild.shape_for(get_preset("tiny"), dtype=torch.float32) == prebuild.KDABackwardShape(2, 32, 32, torch.float32)


def test_no_build_ahead_without_kda_layers_under_cp_or_for_an_uneven_tp_split():
    mini = get_preset("glm53-mini")
    dsa_only = dataclasses.replace(mini, layer_types=("dsa",) * mini.num_layers)
    assert "no KDA layers" in prebuild.shape_for(dsa_only, dtype=torch.bfloat16)
    assert "cp=2" in prebuild.shape_for(mini, dtype=torch.bfloat16, cp=2)
    assert "tp=3" in prebuild.shape_for(mini, dtype=torch.bfloat16, tp=3)
    skipped = prebuild.KDABackwardPrebuild("the model has no KDA layers", torch.device("cpu"))
    skipped.wait()
    assert skipped.describe() == {"outcome": "skipped: the model has no KDA layers", "shape": None, "build_s": None,
                                  "first_backward_waited_s": None}


def test_the_builder_gets_one_chunk_of_zeros_in_fla_s_layout():
    calls = []

    def builder(**kw):
        calls.append({k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in kw.items()})

    shape = prebuild.KDABackwardShape(heads=3, key_dim=16, value_dim=8, dtype=torch.bfloat16)
    run = prebuild.KDABackwardPrebuild(shape, torch.device("cpu"), builder=builder)
    run.wait()
    assert run.outcome == "built" and run.build_s is not None and run.waited_s is not None
    bf, f32 = torch.bfloat16, torch.float32
    # fla's entry: q/k [B,T,H,K], v/v_new/do/dv [B,T,H,V] and A [B,T,H,BT] in the kernel's dtype,
    # g [B,T,H,K] and beta [B,T,H] in fp32, h/dh [B,NT,H,K,V] (state_v_first False: K before V).
    assert calls == [{
        "q": ((1, 64, 3, 16), bf), "k": ((1, 64, 3, 16), bf), "v": ((1, 64, 3, 8), bf), "v_new": ((1, 64, 3, 8), bf),
        "g": ((1, 64, 3, 16), f32), "beta": ((1, 64, 3), f32), "A": ((1, 64, 3, 64), bf),
        "h": ((1, 1, 3, 16, 8), bf), "do": ((1, 64, 3, 8), bf), "dh": ((1, 1, 3, 16, 8), bf), "dv": ((1, 64, 3, 8), bf),
        "scale": 0.25, "chunk_size": 64, "state_v_first": False,
    }]
    assert run.describe()["shape"] == {"heads": 3, "key_dim": 16, "value_dim": 8, "dtype": "bfloat16"}
    run.wait()  # a second wait returns at once
    assert len(calls) == 1


def test_a_failing_build_is_recorded_not_raised():
    def builder(**kw):
        raise RuntimeError("nvcc exited with status 1")

    run = prebuild.KDABackwardPrebuild(prebuild.KDABackwardShape(2, 32, 32, torch.bfloat16), torch.device("cpu"), builder=builder)
    run.wait()
    assert run.outcome.startswith("failed (RuntimeError: nvcc exited with status 1)"), run.outcome
    assert "the first backward builds it" in run.outcome


def test_without_fla_s_tilelang_backend_nothing_is_started(monkeypatch):
    monkeypatch.setattr(prebuild, "_fla_tilelang_builder", lambda: "fla's KDA backward runs its Triton kernels, not TileLang")
    run = prebuild.start(get_preset("glm53-mini"), device="cpu", dtype=torch.bfloat16)
    run.wait()
    assert run.outcome == "skipped: fla's KDA backward runs its Triton kernels, not TileLang"
    assert run._thread is None


def test_the_real_lookup_says_why_when_fla_is_missing():
    # On this CPU machine fla is not installed (the device bundle has it): the lookup explains.
    try:
        import fla  # noqa: F401
    except ImportError:
        why = prebuild._fla_tilelang_builder()
        assert isinstance(why, str) and why.startswith("fla's KDA backends are not loadable (ModuleNotFoundError"), why
    else:  # with fla: its TileLang entry, or the reason it would not run
        found = prebuild._fla_tilelang_builder()
        assert callable(found) or found.startswith("fla's KDA backward runs"), found
