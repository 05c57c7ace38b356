"""The compile pass (genolong.train.compile) on the CPU with inductor: same outputs and gradients as
the eager model under full-layer recompute and the offload hooks, no recompilation on a second
call, state-dict keys unchanged, the compiled modules visible in print(model), and everything undone by remove()."""

import pytest
import torch

from genolong.model import GenoLongForCausalLM, get_preset
from genolong.train.compile import apply_compile
from genolong.train.memory import apply_memory_optimizations
from genolong.train.options import MemoryOptions


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # inductor compiles ~10 graphs with gcc: ~1 min on a quiet 2-core machine, cached after
def test_compiled_model_matches_eager_under_recompute_and_offload():
    torch.manual_seed(0)
    config = get_preset("tiny")
    model = GenoLongForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 96))
    keys = list(model.state_dict())
    ref_loss, ref_grads = _loss_and_grads(model, ids)

    handle = apply_compile(model, sinkhorn="inductor")
    memory = apply_memory_optimizations(model, MemoryOptions(offload=True, offload_layers=2, offload_pinned=False, offload_overlap=False))
    assert handle.counts == {"HyperConnection.forward": 8, "HyperConnection.expand": 8, "RMSNorm.forward": 11,
                             "GatedRMSNorm.forward": 3, "Router.forward": 1, "DenseMLP.forward": 4}
    loss, grads = _loss_and_grads(model, ids)
    assert memory.recompute_calls() == config.num_layers  # the layers really ran under checkpoint
    assert str(model).count("CompiledHyperConnection(") == 8 and str(model).count("Recompute(") == config.num_layers
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
    assert list(model.state_dict()) == keys

    compiled = handle.describe()
    assert compiled["graphs_compiled"] > 0 and compiled["graph_breaks"] == 0
    assert compiled["compile_s"] > 0
    _loss_and_grads(model, ids)
    again = handle.describe()
    assert again["graphs_compiled"] == compiled["graphs_compiled"]  # no recompilation at the same length
    assert again["compile_s"] == compiled["compile_s"]  # and no compile time spent

    memory.remove()
    handle.remove()
    assert "Compiled" not in str(model) and "Recompute" not in str(model)
    assert not any(name in m.__dict__ for m in model.modules() for name in ("forward", "expand"))


def test_without_mhc_the_pass_leaves_the_hyper_connections_to_the_hot_ops():
    model = GenoLongForCausalLM(get_preset("tiny"))
    handle = apply_compile(model, sinkhorn="inductor", mhc=False)
    assert handle.counts == {"RMSNorm.forward": 11, "GatedRMSNorm.forward": 3, "Router.forward": 1, "DenseMLP.forward": 4}
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("HyperConnection") == 8 and "CompiledHyperConnection" not in kinds
    assert kinds.count("CompiledRMSNorm") == 11 and "RMSNorm" not in kinds
    handle.remove()
    assert "Compiled" not in str(model)


def test_unknown_sinkhorn_is_a_clear_error():
    from genolong.errors import GenolongError

    with pytest.raises(GenolongError, match="sinkhorn must be"):
        apply_compile(GenoLongForCausalLM(get_preset("tiny")), sinkhorn="cuda")


@pytest.mark.slow  # one inductor graph (forward and backward) around the custom op
def test_compiled_mhc_with_the_sinkhorn_custom_op_matches_eager():
    from genolong.model.mhc import HyperConnection

    torch.manual_seed(1)
    config = get_preset("tiny")
    hc = HyperConnection(config.hidden, config.mhc, config.rms_eps)
    torch.nn.init.normal_(hc.fn, std=0.05)
    streams = torch.randn(2, 33, 4, config.hidden)
    out = torch.randn(2, 33, config.hidden)

    def run():
        s = streams.clone().requires_grad_()
        post, comb, x = hc(s)
        new = hc.expand(post, comb, x * out, s)
        (new.square().mean() + comb.square().sum()).backward()
        grads = [s.grad] + [p.grad.clone() for p in hc.parameters()]
        hc.zero_grad(set_to_none=True)
        return [post, comb, x, new, *grads]

    eager = run()
    handle = apply_compile(hc, sinkhorn="triton")
    fused = run()
    handle.remove()
    for a, b in zip(fused, eager):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a one-step finetune through the worker process, compiling the tiny model
def test_finetune_compile_flag_reaches_the_run_and_records_what_it_compiled(data, tmp_path):
    import json

    from typer.testing import CliRunner

    from genolong.cli import app
    from genolong.train.options import TrainOptions

    out = tmp_path / "run"
    args = ["finetune", "--data", str(data), "--out", str(out), "--steps", "1", "--preset", "tiny", "--seq", "64",
            "--device", "cpu", "--no-progress", "--warmup", "1", "--compile"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert TrainOptions.from_dict(json.loads((out / "options.json").read_text())).compile
    setup = json.loads((out / "compile.json").read_text())
    assert setup["modules"]["HyperConnection.forward"] == 8 and setup["sinkhorn"] == "inductor"
    assert setup["graphs_compiled"] > 0 and setup["graph_breaks"] == 0


def test_the_compile_pass_is_on_by_default_only_with_the_fused_kernels_on_the_gpu():
    from genolong.model import ops
    from genolong.train.options import TrainOptions
    from genolong.train.passes import compile_pass_on

    assert TrainOptions().compile is None  # unset: decided where the run runs
    assert compile_pass_on(None, True, "fused") and not compile_pass_on(None, True, ops.REFERENCE)
    assert not compile_pass_on(None, False, "fused") and not compile_pass_on(None, False, ops.REFERENCE)
    # Given on the command line, either way wins.
    assert compile_pass_on(True, False, ops.REFERENCE) and not compile_pass_on(False, True, "fused")


def test_a_cpu_finetune_without_the_flag_does_not_compile(data, tmp_path):
    import json

    from typer.testing import CliRunner

    from genolong.cli import app

    out = tmp_path / "run"
    args = ["finetune", "--data", str(data), "--out", str(out), "--steps", "1", "--preset", "tiny", "--seq", "64",
            "--device", "cpu", "--no-progress", "--warmup", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "options.json").read_text())["compile"] is None
    assert not (out / "compile.json").exists()
