"""Training the DSA indexer in the loop: frozen by default, warm-up updates only the indexer, the
sparse stage updates everything, metrics, resume, accumulation, options and the optimizer."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from genolong.cli import app
from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, from_pretrained, get_preset
from genolong.model import indexer_loss as il
from genolong.train import checkpoint as ck
from genolong.train import loop
from genolong.train.flags import ALL
from genolong.train.indexer import IndexerTraining, is_indexer_parameter, trainable_parameters
from genolong.train.metrics import read_jsonl
from genolong.train.optim import MasterAdamW
from genolong.train.options import TrainOptions
from tests.train._helpers import tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = {"seq_len": 64, "warmup": 1, "lr": 1e-2}
TRAINED = {"indexer_loss_coeff": 1.0, "indexer_warmup_steps": 2, "indexer_recall_every": 2, "indexer_recall_queries": 16}


def _initial_weights(options):
    """The weights `train` starts from (same seeding and construction order as the loop)."""
    spec = loop.check_inputs(options)
    loop._seed_everything(options.seed)
    loop.open_sampler(options)
    model, _ = loop._build_model(spec)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _weights(run_dir, step):
    model = from_pretrained(run_dir / ck.CHECKPOINTS / f"step_{step:08d}" / "model", dtype=torch.float32)
    return model.state_dict()


def _same(a, b):
    return torch.equal(a.float(), b.float())


def test_warmup_updates_only_the_indexer_then_everything_trains_and_resume_is_exact(data, tmp_path):
    options = tiny_options(data, tmp_path / "r", steps=3, stop_after=2, **COMMON, **TRAINED)
    initial = _initial_weights(options)
    first = loop.train(options)
    second = loop.train(loop.load_run_options(tmp_path / "r", stop_after=None, progress=False))
    records = first + second
    assert [r["indexer_phase"] for r in records] == ["warmup", "warmup", "sparse"]
    assert all(r["indexer_loss"] > 0 and set(r["indexer_loss_layers"]) == {"3"} for r in records)
    assert [r["indexer_recall"] is not None for r in records] == [True, False, True]
    assert 0 < records[0]["indexer_recall"] < 1

    after_warmup, final = _weights(tmp_path / "r", 2), _weights(tmp_path / "r", 3)
    keys = list(initial)
    for key in keys:
        changed_in_warmup = not _same(after_warmup[key], initial[key])
        assert changed_in_warmup == (".indexer." in key), f"{key}: warm-up must update the indexer and nothing else"
    moved = [k for k in keys if ".indexer." not in k and not _same(final[k], after_warmup[k])]
    assert len(moved) > 0.9 * sum(".indexer." not in k for k in keys), "after the warm-up the whole model trains"

    straight = loop.train(tiny_options(data, tmp_path / "s", steps=3, **COMMON, **TRAINED))
    for key in ("loss", "grad_norm", "indexer_loss", "indexer_recall"):
        assert [r[key] for r in straight] == [r[key] for r in records], key
    logged = read_jsonl(tmp_path / "r" / ck.METRICS_FILE)
    assert [line["indexer_phase"] for line in logged] == ["warmup", "warmup", "sparse"]


def test_a_query_subset_is_drawn_per_step_and_the_same_on_resume(data, tmp_path, monkeypatch):
    # Blocks of 16 queries: a 64-token window has 4, half of them scored each step.
    monkeypatch.setattr(il, "QUERY_BLOCK", 16)
    subset = dict(indexer_loss_coeff=1.0, indexer_loss_queries=0.5, seed=5, **COMMON)
    drawn = []
    real = il.scored_blocks

    def spy(length, fraction, **kw):
        drawn.append((length, fraction, kw))
        return real(length, fraction, **kw)

    monkeypatch.setattr(il, "scored_blocks", spy)
    first = loop.train(tiny_options(data, tmp_path / "r", steps=3, stop_after=2, **subset))
    second = loop.train(loop.load_run_options(tmp_path / "r", stop_after=None, progress=False))
    # (drawn again when the recompute repeats the layer's forward: the same blocks)
    assert sorted({(length, fraction, kw["block"], kw["seed"], kw["step"], kw["layer"]) for length, fraction, kw in drawn}) == [
        (64, 0.5, 16, 5, step, 3) for step in range(3)
    ]
    straight = loop.train(tiny_options(data, tmp_path / "s", steps=3, **subset))
    for key in ("loss", "grad_norm", "indexer_loss"):
        assert [r[key] for r in straight] == [r[key] for r in first + second], key
    every = loop.train(tiny_options(data, tmp_path / "a", steps=1, **{**subset, "indexer_loss_queries": 1.0}))
    assert every[0]["loss"] == straight[0]["loss"] and every[0]["indexer_loss"] != straight[0]["indexer_loss"]


def test_frozen_default_keeps_the_indexer_out_of_the_optimizer(data, tmp_path):
    assert TrainOptions().indexer_loss_coeff == 0
    records = loop.train(tiny_options(data, tmp_path / "f", steps=1, **COMMON))
    assert all(records[0][k] is None for k in ("indexer_phase", "indexer_loss", "indexer_recall"))
    state = load_file(str(tmp_path / "f" / ck.CHECKPOINTS / "step_00000001" / "optimizer.safetensors"))
    assert any(k.startswith("master.") for k in state)
    assert not [k for k in state if ".indexer." in k]
    assert not [k for k in state if k.startswith("step.")]  # every parameter at the global step


def test_recall_alone_measures_a_frozen_indexer(data, tmp_path):
    records = loop.train(tiny_options(data, tmp_path / "q", steps=1, indexer_recall_every=1, indexer_recall_queries=8, **COMMON))
    assert records[0]["indexer_phase"] is None and records[0]["indexer_loss"] is None
    assert set(records[0]["indexer_recall_layers"]) == {"3"} and 0 < records[0]["indexer_recall"] <= 1


def test_grad_accumulation_weights_micro_batches_equally(data, tmp_path):
    kw = dict(steps=1, batch=2, indexer_loss_coeff=1.0, **COMMON)
    whole = loop.train(tiny_options(data, tmp_path / "a", grad_accum=1, **kw))
    split = loop.train(tiny_options(data, tmp_path / "b", grad_accum=2, **kw))
    assert split[0]["indexer_loss"] == pytest.approx(whole[0]["indexer_loss"], rel=1e-5)
    a, b = _weights(tmp_path / "a", 1), _weights(tmp_path / "b", 1)
    for key in a:
        if ".indexer." in key:
            assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key


def test_trainable_parameters_and_the_stage_of_each_step():
    model = GenoLongForCausalLM(get_preset("tiny"))
    frozen = trainable_parameters(model, train_indexer=False)
    assert not [n for n, _ in frozen if is_indexer_parameter(n)]
    assert all(not p.requires_grad for n, p in model.named_parameters() if is_indexer_parameter(n))
    trained = {n for n, _ in trainable_parameters(model, train_indexer=True)}
    assert {n for n, _ in model.named_parameters()} == trained
    with pytest.raises(GenolongError, match=r"--indexer-loss-queries must be in \(0, 1\]"):
        IndexerTraining(model, coeff=0.5, query_fraction=0.0)
    assert str(il.QUERY_BLOCK) in ALL["indexer_loss_queries"].help  # --help names the block size
    stages = IndexerTraining(model, coeff=0.5, warmup_steps=2)
    assert [stages.phase(s) for s in range(4)] == ["warmup", "warmup", "sparse", "sparse"]
    assert IndexerTraining(model).phase(0) == "frozen"
    no_dsa = GenoLongForCausalLM(get_preset("tiny", num_layers=3))
    with pytest.raises(GenolongError, match="no DSA layer|has none"):
        IndexerTraining(no_dsa, coeff=1.0)


def test_partial_steps_count_per_parameter_for_bias_correction():
    # b is first updated at the third step: its update must be Adam's first (bias-corrected) one.
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = MasterAdamW([("a", a), ("b", b)], lr=0.1, weight_decay=0.0)
    for _ in range(2):
        a.grad = torch.ones(3)
        opt.step(0.1, only={"a"})
        opt.zero_grad()
    assert torch.equal(b, torch.ones(3))
    a.grad, b.grad = torch.ones(3), torch.full((3,), 2.0)
    opt.step(0.1)
    assert torch.allclose(b, torch.full((3,), 0.9), atol=1e-6)  # first Adam step: -lr * sign
    state = opt.state_dict()
    assert int(state["step"]) == 3 and int(state["step.b"]) == 1 and "step.a" not in state
    fresh = MasterAdamW([("a", torch.nn.Parameter(torch.ones(3))), ("b", torch.nn.Parameter(torch.ones(3)))], lr=0.1)
    fresh.load_state_dict(state)
    assert fresh.param_steps == {"a": 3, "b": 1}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"indexer_loss_coeff": -1.0}, "--indexer-loss-coeff must be a finite number >= 0"),
        ({"indexer_loss_coeff": float("nan")}, "--indexer-loss-coeff must be a finite number >= 0"),
        ({"indexer_warmup_steps": 3}, "--indexer-warmup-steps 3 trains the indexer, but --indexer-loss-coeff is 0"),
        ({"indexer_recall_every": -1}, "must be >= 0"),
        ({"indexer_loss_coeff": 1.0, "indexer_recall_queries": 0}, "--indexer-recall-queries must be >= 1"),
        ({"indexer_loss_queries": 0.25}, "--indexer-loss-queries 0.25 subsamples the indexer's KL, but --indexer-loss-coeff is 0"),
        ({"indexer_loss_coeff": 1.0, "indexer_loss_queries": 0.0}, "--indexer-loss-queries must be in (0, 1]"),
        ({"indexer_loss_coeff": 1.0, "indexer_loss_queries": 1.5}, "--indexer-loss-queries must be in (0, 1]"),
        ({"indexer_loss_coeff": 1.0, "indexer_loss_queries": float("nan")}, "--indexer-loss-queries must be in (0, 1]"),
    ],
)
def test_bad_indexer_options_are_one_line(data, tmp_path, change, message):
    with pytest.raises(GenolongError, match=re.escape(message[:60])) as err:
        loop.check_inputs(tiny_options(data, tmp_path / "x", **change))
    assert "\n" not in str(err.value)


def test_the_command_line_options_reach_the_run(data, tmp_path):
    out = tmp_path / "c"
    result = CliRunner().invoke(app, [
        "finetune", "--data", str(data), "--out", str(out), "--steps", "1", "--preset", "tiny", "--seq", "64",
        "--device", "cpu", "--no-progress", "--indexer-loss-coeff", "0.5", "--indexer-warmup-steps", "1",
        "--indexer-recall-every", "1", "--indexer-recall-queries", "8", "--indexer-loss-queries", "0.25",
    ])
    assert result.exit_code == 0, result.output
    options = TrainOptions.from_dict(json.loads((out / "options.json").read_text()))
    assert (options.indexer_loss_coeff, options.indexer_warmup_steps, options.indexer_recall_every, options.indexer_recall_queries,
            options.indexer_loss_queries) == (0.5, 1, 1, 8, 0.25)
    assert read_jsonl(out / ck.METRICS_FILE)[0]["indexer_phase"] == "warmup"
