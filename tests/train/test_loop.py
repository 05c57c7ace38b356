"""The training loop on CPU: optimizer, schedule, accumulation, non-finite steps, logs, bad input, overfit."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

from genolong.errors import GenolongError
from genolong.train import loop
from genolong.train.metrics import read_jsonl
from genolong.train.optim import MasterAdamW, clip_scale, lr_at
from tests.train._helpers import tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ optimizer


def test_master_adamw_matches_torch_adamw_on_fp32_params():
    torch.manual_seed(0)
    a = torch.nn.Linear(5, 3)
    b = torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    ours = MasterAdamW(list(a.named_parameters()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # torch decays every parameter it is given: give it the same split (matrices only).
    ref = torch.optim.AdamW(
        [{"params": [b.weight], "weight_decay": 0.1}, {"params": [b.bias], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for i in range(5):
        x = torch.randn(4, 5)
        a(x).pow(2).sum().backward()
        b(x).pow(2).sum().backward()
        ours.step(lr=1e-2)
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.bias, b.bias, rtol=1e-6, atol=1e-7)


def test_bf16_params_keep_fp32_master_and_state():
    p = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    opt = MasterAdamW([("w", p)], lr=1e-4, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.step(lr=1e-4)
    state = opt.state_dict()
    assert state["master.w"].dtype == torch.float32 and state["exp_avg_sq.w"].dtype == torch.float32
    # 3 updates of ~1e-4 are below bf16's resolution at 1.0 (2^-8): only the fp32 master keeps them.
    assert p.dtype == torch.bfloat16 and torch.all(p == 1.0)
    assert torch.allclose(state["master.w"], torch.full((4, 4), 1 - 3e-4), atol=1e-6)
    fresh = MasterAdamW([("w", torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16)))], lr=1e-4)
    fresh.load_state_dict(state)
    assert fresh.step_count == 3 and torch.equal(fresh.master["w"], state["master.w"])


def test_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 1.0, warmup=4, total=20, min_ratio=0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(x >= y for x, y in itertools.pairwise(lrs[3:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert lr_at(0, 1.0, warmup=0, total=10, min_ratio=0.0) == 1.0


def test_clip_scale():
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(4.0, 1.0) == pytest.approx(0.25, rel=1e-5)
    assert clip_scale(4.0, 0.0) == 1.0


# ------------------------------------------------------------------------------ the loop


def test_loop_writes_one_record_per_step_and_a_checkpoint(data, tmp_path):
    records = loop.train(tiny_options(data, tmp_path / "run", steps=3, seq_len=128))
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and not r["skipped"]
        assert r["tokens"] == 128 and 0 < r["valid_tokens"] <= 128
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["hardware_tflops"] > r["model_tflops"]
        assert r["mfu"] is None and r["peak_gpu_gib"] is None  # CPU: no peak FLOP/s, no GPU memory
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == json.loads(json.dumps(records))
    assert (tmp_path / "run" / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    audit = json.loads((tmp_path / "run" / "kernels.json").read_text())
    assert audit["kda"] == {"reference": 3}  # tiny: layers 0-2 KDA, layer 3 DSA
    memory = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert memory["recompute"] is True and memory["offload_layers"] == []


def test_grad_accumulation_equals_one_big_batch(data, tmp_path):
    """The global valid count makes 2 micro-batches of 1 the same step as 1 micro-batch of 2."""
    whole = loop.train(tiny_options(data, tmp_path / "a", steps=2, seq_len=128, batch=2, grad_accum=1))
    split = loop.train(tiny_options(data, tmp_path / "b", steps=2, seq_len=128, batch=2, grad_accum=2))
    for w, s in zip(whole, split):
        assert w["valid_tokens"] == s["valid_tokens"]
        assert s["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert s["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)


def test_nonfinite_steps_are_skipped_then_the_run_stops(data, tmp_path, monkeypatch):
    real = loop.chunked_lm_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] >= 2 else loss

    monkeypatch.setattr(loop, "chunked_lm_loss", poisoned)
    options = tiny_options(data, tmp_path / "run", steps=10, seq_len=128, max_nonfinite=3)
    with pytest.raises(loop.TrainingStopped, match="3 consecutive steps had a non-finite loss.*no checkpoint was saved: "
                       "the same command plus --overwrite and a lower --lr"):
        loop.train(options)
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [line["skipped"] for line in lines] == [False, True, True, True]
    assert lines[-1]["nonfinite_total"] == 3 and lines[-1]["loss"] == "nan"


def test_skipped_step_leaves_weights_unchanged(data, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "chunked_lm_loss", lambda *a, **k: torch.tensor(float("inf"), requires_grad=True))
    seen = {}
    real_step = loop._train_step

    def spy(ctx, *args, **kwargs):
        before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
        record = real_step(ctx, *args, **kwargs)
        seen["same"] = all(torch.equal(before[k], v) for k, v in ctx.model.state_dict().items())
        return record

    monkeypatch.setattr(loop, "_train_step", spy)
    with pytest.raises(loop.TrainingStopped):
        loop.train(tiny_options(data, tmp_path / "run", steps=3, seq_len=128, max_nonfinite=1))
    assert seen["same"]


def test_bad_input_is_one_clear_error(data, tmp_path):
    with pytest.raises(GenolongError, match="no such directory"):
        loop.train(tiny_options(tmp_path / "missing", tmp_path / "r1"))
    with pytest.raises(GenolongError, match="longest .train. record .* has 20,000"):
        loop.train(tiny_options(data, tmp_path / "r2", seq_len=32 * 1024))  # longest record is 20,000 bases
    with pytest.raises(GenolongError, match="unknown model preset"):
        loop.train(tiny_options(data, tmp_path / "r3", preset="glm-9"))
    with pytest.raises(GenolongError, match="not divisible by --grad-accum"):
        loop.train(tiny_options(data, tmp_path / "r4", batch=3, grad_accum=2))
    loop.train(tiny_options(data, tmp_path / "r5", steps=1, seq_len=64))
    with pytest.raises(GenolongError, match="already holds a run"):
        loop.train(tiny_options(data, tmp_path / "r5", steps=1, seq_len=64))


@pytest.mark.slow
def test_overfit_four_windows_loss_falls_80_percent_in_50_steps(data, tmp_path):
    """Seed optimization 9's overfit check on CPU: the whole stack can drive the loss down."""
    records = loop.train(
        tiny_options(
            data, tmp_path / "run", seq_len=128, steps=50, overfit=4, batch=4, lr=1e-2, warmup=5, weight_decay=0.0
        )
    )
    losses = [r["loss"] for r in records]
    assert len(losses) == 50 and all(math.isfinite(x) for x in losses)
    assert min(losses[-5:]) <= 0.2 * losses[0], losses


def test_expandable_segments_are_the_default_but_a_user_allocator_setting_wins():
    from genolong.train.loop import default_cuda_allocator

    env = {}
    assert default_cuda_allocator(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        user = {name: "max_split_size_mb:512"}
        assert not default_cuda_allocator(user) and user == {name: "max_split_size_mb:512"}


def test_repeat_weight_weights_the_soft_masked_targets(data):
    from genolong.train.loop import _split
    from genolong.train.resolve import open_sampler

    options = tiny_options(data, data, seq_len=512, batch=2, grad_accum=2, repeat_weight=0.1)
    windows = [w for w, _ in zip(open_sampler(options), range(2))]
    batches = _split(windows, options, None, "cpu")
    repeats = torch.from_numpy(np.stack([w.repeat_mask for w in windows]))[:, 1:]
    weight = torch.cat([b.weight for b in batches])
    valid = torch.cat([b.valid for b in batches])
    assert (repeats & valid).any() and (~repeats & valid).any()
    assert torch.equal(weight[valid & repeats], torch.full_like(weight[valid & repeats], 0.1))
    assert torch.equal(weight[valid & ~repeats], torch.ones_like(weight[valid & ~repeats]))
    assert weight[~valid].abs().sum() == 0
    options.repeat_weight = 1.0
    assert all(b.weight is None for b in _split(windows, options, None, "cpu"))  # the unweighted path, unchanged


def test_hardware_flops_follow_the_micro_batch_the_moe_sees(data, tmp_path):
    # Two sequences of 200 tokens in two micro-batches: each MoE forward sees 200 tokens, one
    # chunk of 300, so no chunk checkpoint runs the MoE again (the whole step's 400 tokens would).
    from genolong.model import get_preset
    from genolong.train.flops import step_flops
    from genolong.train.options import MemoryOptions

    memory = MemoryOptions(offload=False, moe_chunk_tokens=300)
    loop.train(tiny_options(data, tmp_path / "run", steps=1, seq_len=200, batch=2, grad_accum=2, memory=memory))
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["hardware_tflops"]
    plain = step_flops(get_preset("tiny"), 200, recompute=True, chunked_loss=memory.chunked_loss, moe_recompute=False).scaled(2)
    chunked = step_flops(get_preset("tiny"), 200, recompute=True, chunked_loss=memory.chunked_loss, moe_recompute=True).scaled(2)
    assert chunked.hardware > plain.hardware
    assert logged == pytest.approx(plain.hardware / 1e12, rel=1e-6)


def test_the_offload_pool_is_given_back_before_the_last_save_only(data, tmp_path, monkeypatch):
    # The last save copies the optimizer state to host memory while, without this, the pool
    # (~100 GiB at 1M) would still be held; periodic saves keep it (the next step needs it).
    from genolong.train import memory as memory_mod
    from genolong.train.options import MemoryOptions

    events = []
    release = memory_mod.MemoryHandle.release_host

    def recorded_release(handle):
        held = handle.reserved_bytes()
        release(handle)
        events.append(("release", held, handle.reserved_bytes()))

    save = loop._save
    monkeypatch.setattr(memory_mod.MemoryHandle, "release_host", recorded_release)
    monkeypatch.setattr(loop, "_save", lambda run_dir, step, *a: (events.append(("save", step)), save(run_dir, step, *a)))
    opts = tiny_options(data, tmp_path / "run", steps=2, seq_len=128, save_every=1, memory=MemoryOptions(offload=True, offload_layers=2))
    loop.train(opts)
    assert [e[0] for e in events] == ["save", "release", "save"]
    _, held, after = events[1]
    assert held > 0 and after == 0


def test_the_run_directory_keeps_the_plan_it_started_under(data, tmp_path):
    from genolong.train.options import MemoryOptions
    from genolong.train.plan import estimate_cpu_memory
    from genolong.train.resolve import model_config

    opts = tiny_options(data, tmp_path / "run", steps=1, seq_len=256, memory=MemoryOptions(offload=False, tile_tokens=64))
    loop.train(opts)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    expected = estimate_cpu_memory(model_config(opts), 256, MemoryOptions(offload=False, tile_tokens=64))
    assert plan["device"] == "cpu" and plan["fits"] is True and plan["tile_tokens"] == 64
    assert plan["gpu"] == expected.gpu and plan["gpu_total"] == expected.gpu_total == sum(plan["gpu"].values())
