"""The plan's side of bench_real_layers.py's memory check (benchmarks/real_layers_plan.py): each
cell's figure is the plan's items for the cell's part, slice and length, checked against the
formulas of docs/memory.md and docs/parallel.md ("Activations (full recompute)", "transients")
written out by hand for GLM-5.3-Flash (hidden 4096, a = 2 bytes)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_layers_plan import DISPATCH, ITEM_PART, compare, plan_cell  # noqa: E402

from genolong.model.presets import glm53_flash  # noqa: E402
from genolong.train.plan import layer_saved_items  # noqa: E402

K128, K64 = 131072, 65536
A, H = 2, 4096
GIB = 1 << 30


def rmsnorm(dim):
    return 4 * dim + 2 * A * dim  # fp32 copy, normalised value and output in bf16


def test_every_plan_item_of_every_layer_kind_belongs_to_one_part():
    # A new item in the plan must be assigned to a cell's part (or to none), not dropped silently.
    config = glm53_flash()
    kinds = {(config.layer_types[i], config.mlp_types[i]): i for i in range(config.num_layers)}
    assert len(kinds) == 3  # KDA + dense, DSA + MoE, KDA + MoE
    for i in kinds.values():
        assert set(layer_saved_items(config, i)) <= set(ITEM_PART), i


def test_kda8_at_128k_by_hand():
    ts, tc = K128 // 8, K128  # tp=8: every head on Ts tokens, what each tp rank holds on Tc
    c = 64 * 128
    items = {
        "kda conv (fp32)": 2 * 4 * 3 * c * ts,
        "kda gates": (2 * A * 128 + 2 * 4 * c + A * 64) * ts,
        "kda op inputs": (3 * A * c + 4 * c) * ts,
        "kda out norm": (4 * 4 * c + A * c) * ts,
        "kda op internals": (2 * 4 * 64 * 64 + 2 * 4 * 64) * ts,
        # f_a / g_a outputs held for the whole shard (the gathered input is the cell's own input)
        "kda held for the whole shard by each tp rank": 2 * A * 128 * (tc - ts),
    }
    plan = plan_cell("kda8", K128)
    assert plan["items"] == items
    chunk_states = 2 * 4 * (tc // 64) * (64 // 8) * 128 * 128
    conv_grads = 2 * 4 * 3 * c * ts  # the fp32 conv's two gradients: larger than the chunk states
    assert conv_grads > chunk_states
    assert plan["peak"] == "kda conv gradients (fp32)"
    assert plan["terms"] == {"saved items": sum(items.values()), "gradient in": A * H * tc, "backward peak": conv_grads}
    assert plan["bytes"] == sum(items.values()) + A * H * tc + conv_grads
    assert plan["excluded"]["tp-gathered sublayer inputs"] == 2 * A * H * (tc - ts)  # mixer's and dense MLP's


def test_dsa8_at_64k_by_hand():
    ts, tc = K64 // 8, K64
    width = 512 * 4 + 3  # 512 pools of 4 keys and the query's own tail pool
    items = {
        "dsa projections": (rmsnorm(1536) + A * 64 * 256 + rmsnorm(512)) * ts,
        "dsa latent q/out": (2 * A * 64 * 512 + A * 64 * 256) * ts,
        "dsa top-k indices": 4 * width * ts,
        "dsa op internals": 4 * 64 * ts,
        "dsa held for the whole shard by each tp rank": (rmsnorm(1536) + rmsnorm(512) + 4 * width) * (tc - ts),
    }
    plan = plan_cell("dsa8", K64)
    assert plan["items"] == items
    # The sparse attention's backward on 8 heads: the incoming gradient of its output and dq (bf16)
    # and the fp32 row statistic per query, less the output projection's input (8 x 256, freed by
    # its backward before), the fp32 dkv over the 64k latent rows (4 key chunks of 16k), and one
    # query chunk of 1 GiB (row bytes 2051 x 20 + 5 x 12 + 8 x 512 x 4 = 57,464; 64k rows are 3.5 GiB).
    workspace = tc * 8 * (2 * A * 512 + 4 - A * 256) + 4 * 512 * tc + (1 << 30)
    assert plan["peak"] == "dsa attention workspace"
    assert plan["bytes"] == sum(items.values()) + A * H * tc + workspace


def test_moe36_is_one_ep8_rank_at_an_eighth_of_the_tokens_without_the_dispatch():
    ts = K128 // 8  # each ep rank routes its own sequence of S / 8 tokens
    items = {
        "moe router": (4 * H + 4 * 288 + 8 * 8 + 3 * 4 * 8) * ts,
        "moe routed": 8 * (A * (2 * H + 3 * 2048) + 4 + 2 * 8) * ts,
        "moe shared": 6 * A * 2048 * ts,
        "moe rows at the busiest ep rank": 0,  # skew 1: random tokens route evenly
    }
    plan = plan_cell("moe36", K128)
    assert plan["layout"] == "ep=8" and plan["tokens"]["seq"] == ts
    assert plan["items"] == items
    assert plan["excluded"][DISPATCH] == 2 * 8 * A * H * ts
    # 16k tokens are 6 of the op's chunks (2,978 tokens: 1 GiB / 8 x (2 x (4096 + 3 x 2048 + 4096) + 4 x 4096)):
    # the running sums of the 36 experts' gate/up and down weight gradients and the newest chunk's
    # gate/up (1.125 + 0.5625 + 1.125 GiB) outweigh gate/up's gradient (1 GiB).
    weight_grad = A * 36 * (2 * (2 * 2048 * H) + 2048 * H)
    assert weight_grad > 8 * A * 2 * 2048 * ts
    assert plan["peak"] == "moe expert weight gradients (chunk sums)"
    assert plan["bytes"] == sum(items.values()) + A * H * ts + weight_grad


def test_moe144_is_ep2s_rank_at_half_the_tokens_holding_half_the_weight_gradient_sums():
    th = K128 // 2
    plan = plan_cell("moe144", K128)
    assert plan["layout"] == "ep=2" and plan["tokens"]["seq"] == th
    assert plan["peak"] == "moe expert weight gradients (chunk sums)"
    # 64k tokens routed over 144 of 288 experts: the same per-token items and incoming gradient as one
    # process at 64k; only the running weight-gradient sums are the rank's 144 experts'.
    weight_grad = A * 144 * (2 * (2 * 2048 * H) + 2048 * H)
    assert plan["terms"]["backward peak"] == weight_grad
    assert plan["terms"]["gradient in"] == A * H * th
    whole = plan_cell("moe288", th)
    assert plan["terms"]["saved items"] == whole["terms"]["saved items"]
    assert whole["terms"]["backward peak"] == 2 * weight_grad


def test_mlp_and_mhc_by_hand():
    ts, tc = K128 // 8, K128
    mlp = 6 * A * (12288) * ts  # = 6 a (12288 / 8) over the shard
    swiglu_grads = 2 * A * 12288 * ts
    assert plan_cell("mlp", K128)["bytes"] == mlp + A * H * tc + swiglu_grads

    t, n = K64, 4
    mixing = 2 * (4 * 3 + 2 * 4 * 24 + 4 * (3 * n + 2 * n * n) + A * n)  # two hyper-connections
    sinkhorn = 2 * (2 * 20 - 1) * 4 * (n * n + n)
    expand = (A * H + A * n + A * n * n + A * n * H) + (A * H + A * n + A * n * n)
    plan = plan_cell("mhc", K64)
    assert plan["terms"]["saved items"] == (mixing + sinkhorn + expand) * t
    assert plan["terms"]["gradient in"] == n * H * A * t
    assert plan["terms"]["backward peak"] == 2 * n * H * A * t  # the residual path's and the mixing's
    assert "norms" in plan["excluded"]


def test_unknown_cells_have_no_figure_and_the_ratio_is_measured_over_plan():
    with pytest.raises(KeyError, match="sdpa-kda8"):
        plan_cell("sdpa-kda8", K128)
    assert compare(11.0, 10.0) == {"plan_gib": 10.0, "measured_gib": 11.0, "measured_over_plan": 1.1, "within_10pct": True}
    assert compare(8.9, 10.0)["within_10pct"] is False


def test_dry_run_prints_the_plan_for_the_check_cells_on_the_cpu():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_real_layers.py"), "--dry-run", "--plan-check",
         "--groups", "tp8,moe36,mlp,mhc", "--sizes", "128k"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if " plan " in line]
    assert [line.split()[0] for line in lines] == ["moe36", "mlp", "mhc", "dsa8", "kda8"]  # the run order
    kda = next(line for line in lines if line.startswith("kda8"))
    assert f"{plan_cell('kda8', K128)['gib']:7.2f} GiB" in kda
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_real_layers.py"), "--dry-run", "--sizes", "96k"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown --sizes 96k" in bad.stderr


def test_cells_narrow_the_groups_and_a_cell_outside_them_is_refused():
    script = [sys.executable, str(ROOT / "benchmarks" / "bench_real_layers.py"), "--dry-run", "--plan-check", "--sizes", "128k"]
    done = subprocess.run(script + ["--groups", "tp1,moe288", "--cells", "moe288,dsa64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines() if " plan " in line] == ["dsa64", "moe288"]
    bad = subprocess.run(script + ["--groups", "tp1", "--cells", "moe288"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown --cells moe288 for --groups tp1: use dsa64, kda64" in bad.stderr


def test_the_table_says_which_cells_are_off_by_more_than_ten_percent():
    from bench_real_layers import plan_table

    rows = [
        {"cell": "kda8", "size": "128k", "recompute_peak_gib": 13.6, "measured_upper_gib": 13.55, **compare(13.5, 15.07),
         "plan_layout": "tp=8",
         "plan_tokens": {"shard": K128, "seq": K128 // 8}},
        {"cell": "mlp", "size": "128k", "recompute_peak_gib": 6.6, "measured_upper_gib": 6.52, **compare(6.5, 6.5),
         "plan_layout": "tp=8",
         "plan_tokens": {"shard": K128, "seq": K128 // 8}},
        {"cell": "dsa8", "size": "128k", "not_run": "out of memory: ..."},
        {"cell": "sdpa-kda8", "size": "128k", "ms": 1.0},
    ]
    lines = plan_table(rows)
    kda = next(line for line in lines if line.startswith("kda8"))
    mlp = next(line for line in lines if line.startswith("mlp"))
    assert "0.896" in kda and "NO" in kda
    assert "1.000" in mlp and "yes" in mlp
    assert any(line.startswith("dsa8") and "not measured: out of memory" in line for line in lines)
    assert not any(line.startswith("sdpa") for line in lines)


def test_the_dsa_probe_replays_kept_results_and_takes_out_the_weight_gradients(monkeypatch):
    # The GPU measurement's path on the CPU (reference ops) with the allocator's counters stubbed
    # as a backward whose working set is 3 GiB on top of the weight gradients made so far: the
    # recompute takes the selection and attention from the forward, as the training's does, and the
    # weight gradients (the plan's static "gradients") come out of the peak as they appear.
    import torch

    import bench_real_layers as bench
    from genolong.model.dsa import DSAAttention
    from genolong.model.presets import tiny
    from genolong.train.keep import KeptResults

    c = tiny()
    torch.manual_seed(0)
    layer = DSAAttention(c.hidden, c.dsa, c.rms_eps, c.layer_types.index("dsa"), has_indexer=True)
    x = torch.randn(1, 256, c.hidden, requires_grad=True)
    params = list(layer.parameters())
    layer(x)[0].sum().backward()  # which weights a backward gives gradients (not the frozen indexer's)
    grads = sum(p.numel() * 4 for p in params if p.grad is not None)  # fp32 on the CPU
    largest = max(p.numel() * 4 for p in params if p.grad is not None)
    assert 0 < grads < sum(p.numel() * 4 for p in params)

    def made():
        return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 * GIB + 3 * GIB + made())
    keepers = []

    class Counted(KeptResults):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            keepers.append(self)

    monkeypatch.setattr(bench, "KeptResults", Counted)
    got = bench.recompute_working_set(bench.Probe(layer, x, params, pick=lambda o: o[0], keep=True))

    assert len(keepers) == 2  # the warm-up and the measured call
    assert all(k.where == "device" and k.stats.recorded == 2 and k.stats.replayed == 2 for k in keepers)
    assert got["weight_grad_gib"] == round(grads / GIB, 3)
    assert got["working_set"] == pytest.approx(3.0)
    # the bound that keeps an interval's new gradients in: at most the largest weight's more
    assert 3.0 <= got["upper_gib"] <= round((3 * GIB + largest) / GIB, 3) + 1e-3
    assert got["recompute_peak_gib"] == round((3 * GIB + grads) / GIB, 3)
    assert x.grad is None and all(p.grad is None for p in params)  # nothing left for the next cell
