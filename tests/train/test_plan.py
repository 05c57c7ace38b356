"""The memory plan against independent counts, and the pre-flight's refusals (genolong.train.plan)."""

import pytest
import torch
from typer.testing import CliRunner

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset, ops
from genolong.train.census import layer_saved_bytes_per_token
from genolong.train.options import MemoryOptions
from genolong.train.plan import (
    GIB,
    H200_BYTES as H200,
    estimate_cpu_memory,
    estimate_memory,
    layer_saved_bytes,
    static_bytes,
    stored_input_bytes_per_token,
)
from genolong.train.preflight import preflight


def _meta_model(name, dtype=torch.bfloat16):
    with torch.device("meta"):
        return GenoLongForCausalLM(get_preset(name), dtype=dtype, init=False)


@pytest.mark.parametrize("name", ["tiny", "glm53-mini", "glm-5.3-flash"])
def test_weight_and_gradient_bytes_equal_the_built_model(name):
    model = _meta_model(name)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    plan = static_bytes(get_preset(name), dtype_bytes=2)
    assert plan["weights"] == built + buffers
    assert plan["gradients"] == built  # a gradient has its parameter's dtype


def test_optimizer_state_bytes_equal_master_adamw():
    from genolong.train.optim import MasterAdamW

    config = get_preset("tiny")
    model = GenoLongForCausalLM(config, dtype=torch.bfloat16)
    opt = MasterAdamW(list(model.named_parameters()), lr=1e-3)
    held = 0
    for table in (opt.exp_avg, opt.exp_avg_sq):
        held += sum(t.numel() * t.element_size() for t in table.values())
    params = dict(model.named_parameters())
    # fp32 parameters are their own master (the same storage), so only copies count.
    held += sum(
        m.numel() * m.element_size()
        for name, m in opt.master.items()
        if m.untyped_storage().data_ptr() != params[name].untyped_storage().data_ptr()
    )
    assert static_bytes(config, dtype_bytes=2)["optimizer state"] == held


def test_stored_inputs_are_four_streams_per_layer():
    config = get_preset("glm53-mini")
    seq = 131072
    est = estimate_memory(config, seq, MemoryOptions(offload=False))
    assert est.gpu["stored layer inputs"] == config.num_layers * seq * 4 * config.hidden * 2
    assert stored_input_bytes_per_token(config) == 4 * 512 * 2


def test_offloaded_layers_move_from_gpu_to_host():
    config = get_preset("glm53-mini")
    seq = 524288
    # (keep_sparse off: offload also changes where the kept DSA results wait, tested below)
    kept = estimate_memory(config, seq, MemoryOptions(offload=False, keep_sparse="off"))
    moved = estimate_memory(config, seq, MemoryOptions(offload_layers=10, keep_sparse="off"))
    layer_input = seq * stored_input_bytes_per_token(config)
    assert moved.host_total == 10 * layer_input
    # Ten inputs leave the backward peak (at the top layer), one upload buffer comes back.
    assert kept.gpu_total - moved.gpu_total == 10 * layer_input - layer_input


def test_kept_dsa_results_wait_on_the_host_or_the_gpu():
    config = get_preset("glm53-mini")
    seq = 524288
    n_dsa = sum(t == "dsa" for t in config.layer_types)
    # Per DSA layer and token: 512 pool indices + 3 tail slots (int32), 4 heads x 512 bf16 out, 4 fp32 lse.
    per_layer = seq * ((512 + 3) * 4 + 4 * 512 * 2 + 4 * 4)
    off = estimate_memory(config, seq, MemoryOptions(offload_layers=12, keep_sparse="off"))
    host = estimate_memory(config, seq, MemoryOptions(offload_layers=12, keep_sparse="host"))
    device = estimate_memory(config, seq, MemoryOptions(offload_layers=12, keep_sparse="device"))
    assert n_dsa == 11
    assert host.host["kept DSA results (pinned)"] == n_dsa * per_layer
    assert host.host_total - off.host_total == n_dsa * per_layer
    assert host.gpu_total - off.gpu_total == 2 * per_layer  # the layer recomputing and the next, uploaded
    assert device.gpu_total - off.gpu_total == n_dsa * per_layer and device.host_total == off.host_total
    assert estimate_memory(config, seq, MemoryOptions(recompute=False, offload=False)).host_total == 0


def test_budgeted_offload_count_is_the_fewest_that_fit():
    config = get_preset("glm53-mini")
    opts = MemoryOptions(gpu_budget_gib=100)
    est = estimate_memory(config, 524288, opts)
    assert est.fits_gpu and 0 < est.offload_layers < config.num_layers
    fewer = estimate_memory(config, 524288, opts, offload_layers=est.offload_layers - 1)
    assert not fewer.fits_gpu


# --------------------------------------------------------------- census of what autograd saves


class _KeepInputs(torch.autograd.Function):
    """A fused-kernel stand-in that keeps exactly its inputs (and optionally its output)."""

    @staticmethod
    def forward(ctx, fn, kwargs, keep_out, *tensors):
        with torch.no_grad():
            out = fn(*tensors, **kwargs)
        ctx.save_for_backward(*tensors, *([out] if keep_out else []))
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise AssertionError("the census never runs backward")


@pytest.fixture
def fused_stand_ins(monkeypatch):
    """Route the hot ops through stand-ins that save what the GPU kernels save (their inputs and,
    for DSA, the output), and MoE through the real grouped-expert code."""
    from genolong.kernels.moe.combine import combine_index_add
    from genolong.kernels.moe.grouped import experts_grouped, grouped_mm_loop, swiglu_eager
    from genolong.model.dsa import sparse_attention_reference
    from genolong.model.kda import kda_reference

    impls = {op: dict(v) for op, v in ops._IMPLS.items()}
    impls["kda"]["stand_in"] = lambda q, k, v, g, beta: _KeepInputs.apply(kda_reference, {}, False, q, k, v, g, beta)
    impls["dsa_sparse_attention"]["stand_in"] = lambda q, kv, idx, *, scale: _KeepInputs.apply(
        sparse_attention_reference, {"scale": scale}, True, q, kv, idx
    )
    # The Triton SwiGLU and combine (genolong.kernels.moe) keep only their inputs: the packed
    # gate/up; the expert outputs, the sort order and the weights.
    swiglu = lambda gate_up, limit: _KeepInputs.apply(swiglu_eager, {"limit": limit}, False, gate_up)  # noqa: E731
    combine = lambda out, order, weight, k: _KeepInputs.apply(combine_index_add, {"k": k}, False, out, order, weight)  # noqa: E731
    impls["moe_experts"]["stand_in"] = lambda *a, **kw: experts_grouped(*a, mm=grouped_mm_loop, swiglu=swiglu, combine=combine, **kw)
    monkeypatch.setattr(ops, "_IMPLS", impls)
    with ops.policy("auto"):
        yield


def test_moe_saved_bytes_match_a_census_of_the_grouped_path(fused_stand_ins):
    # The MoE alone (its routed part dominates): the plan counts what the GPU's grouped path keeps.
    from genolong.model.moe import MoE
    from genolong.train.census import saved_bytes
    from genolong.train.plan import _moe

    config = get_preset("tiny")
    torch.manual_seed(0)
    block = MoE(config.hidden, config.moe, 3).to(torch.bfloat16)
    block.gate.float()  # the router is kept in fp32, as the model keeps it
    seq = 512
    x = torch.randn(1, seq, config.hidden, dtype=torch.bfloat16, requires_grad=True)
    measured, _ = saved_bytes(lambda: block(x), [*block.parameters(), *block.buffers(), x])
    planned = sum(_moe(config, 2).values()) * seq
    assert planned == pytest.approx(measured, rel=0.05), (planned, measured)


def test_layer_activation_bytes_match_a_census_of_saved_tensors(fused_stand_ins):
    config = get_preset("tiny")
    torch.manual_seed(0)
    model = GenoLongForCausalLM(config, dtype=torch.bfloat16)
    seq = 256
    for idx in (0, 3):  # a KDA + dense layer and a DSA + MoE layer
        layer = model.model.layers[idx]
        streams = torch.randn(1, seq, config.mhc.num_streams, config.hidden, dtype=torch.bfloat16, requires_grad=True)
        measured = layer_saved_bytes_per_token(layer, streams)
        planned = layer_saved_bytes(config, idx, dtype_bytes=2, op_internals=False)
        assert planned == pytest.approx(measured, rel=0.05), (idx, planned, measured)


@pytest.mark.parametrize("chunk_tokens", [512, 64])
def test_moe_chunking_saves_what_the_plan_says_at_and_below_one_chunk(fused_stand_ins, chunk_tokens):
    # memory.py checkpoints MoE chunks only when the sequence is longer than one chunk; a single
    # chunk runs as the plain MoE and saves its activations. The plan must count the same (the
    # H200 ablation without recompute at 32k, below the 64k default chunk, caught it assuming
    # chunking: 100 GiB planned, 135 GiB measured).
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.plan import moe_chunks_checkpointed

    config = get_preset("tiny")
    torch.manual_seed(0)
    model = GenoLongForCausalLM(config, dtype=torch.bfloat16)
    opts = MemoryOptions(recompute=False, offload=False, moe_chunking=True, moe_chunk_tokens=chunk_tokens)
    handle = apply_memory_optimizations(model, opts)
    seq, idx = 256, 3  # layer 3: DSA + MoE
    layer = model.model.layers[idx]
    streams = torch.randn(1, seq, config.mhc.num_streams, config.hidden, dtype=torch.bfloat16, requires_grad=True)
    measured = layer_saved_bytes_per_token(layer, streams)
    handle.remove()
    chunked = moe_chunks_checkpointed(seq, opts)
    assert chunked == (seq > chunk_tokens)
    planned = layer_saved_bytes(config, idx, dtype_bytes=2, moe_chunked=chunked, op_internals=False)
    unchunked = layer_saved_bytes(config, idx, dtype_bytes=2, moe_chunked=False, op_internals=False)
    assert planned == pytest.approx(measured, rel=0.05), (chunk_tokens, planned, measured)
    if chunked:  # the census tells the two apart: the unchunked count would be off by > 10%
        assert unchunked > 1.1 * measured, (unchunked, measured)


def test_plan_without_recompute_below_one_moe_chunk_counts_the_moe():
    config = get_preset("glm53-mini")
    chunked = MemoryOptions(recompute=False, offload=False, moe_chunking=True)
    plain = MemoryOptions(recompute=False, offload=False, moe_chunking=False)
    at = lambda n, o: estimate_memory(config, n, o, 1, 141 * GIB).gpu["activations (no recompute)"]  # noqa: E731
    assert at(32768, chunked) == at(32768, plain)
    assert at(131072, chunked) < 0.8 * at(131072, plain)


# ------------------------------------------------------------------------------- pre-flight


def test_preflight_refuses_the_baseline_at_512k_and_names_the_flag():
    config = get_preset("glm53-mini")
    with pytest.raises(GenolongError) as err:
        preflight(config, 524288, MemoryOptions.baseline(), gpu_bytes=int(139.8 * GIB), host_bytes=128 * GIB)
    message = str(err.value)
    assert "does not fit" in message and "GiB" in message
    assert "--recompute --offload" in message  # recompute alone is not enough at 512k
    with pytest.raises(GenolongError, match="--recompute"):
        preflight(config, 65536, MemoryOptions.baseline(), gpu_bytes=int(139.8 * GIB), host_bytes=128 * GIB)


def test_preflight_names_no_flag_when_nothing_fits():
    # glm-5.3-flash's weights and optimizer state alone exceed one GPU: no --seq helps, GPUs do.
    # On H200s 64 are not enough once FSDP's gathered layer and the cp-gathered tensors are counted
    # (tests/train/test_plan_parallel.py); the advice names the layout on the fewest GPUs that fits.
    with pytest.raises(GenolongError, match="GPU memory short: .* it would fit with more GPUs: --gpus 128 --parallel [^;]*--fsdp[^;]*; see") as err:
        preflight(get_preset("glm-5.3-flash"), 1 << 20, MemoryOptions(host_budget_gib=4096), n_gpus=1, gpu_bytes=int(139.8 * GIB))
    assert "--seq" not in str(err.value)


def test_preflight_checks_host_memory_too():
    opts = MemoryOptions(offload_layers=40, host_budget_gib=8)
    with pytest.raises(GenolongError, match="pinned host"):
        preflight(get_preset("glm53-mini"), 524288, opts, gpu_bytes=int(139.8 * GIB))


def test_preflight_passes_a_run_that_fits():
    est = preflight(get_preset("glm53-mini"), 32768, MemoryOptions(), gpu_bytes=int(139.8 * GIB), host_bytes=128 * GIB)
    assert est.fits and est.offload_layers == 0


def test_plan_command_prints_gpu_and_host():
    from genolong.cli import app

    # --gpus 64 alone: cp=64 with FSDP, which fits 64 B200s (not H200s: tests/train/test_plan_parallel.py).
    args = ["plan", "--seq", "1M", "--preset", "glm-5.3-flash", "--gpus", "64", "--gpu-type", "b200", "--host-budget-gib", "204.8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "a plan" in result.output  # 64 GPUs: context parallelism and FSDP genolong does not run yet
    for word in ("weights", "optimizer state", "stored layer inputs", "total pinned", "fits"):
        assert word in result.output
    result = CliRunner().invoke(app, ["plan", "--seq", "512k", "--preset", "glm53-mini", "--baseline", "--host-gib", "128"])
    assert result.exit_code == 3 and "does not fit" in result.output
    assert "--host-gib is deprecated; use --host-budget-gib 102.4" in result.output


def test_backward_peak_counts_only_the_inputs_still_stored():
    from genolong.train.plan import offload_layers_needed, recompute_peak

    # Layer 0 has the largest working set, but while it runs the inputs above it are gone.
    assert recompute_peak(5, [100, 10, 10, 10], 0) == (5, 0, 0)  # small inputs: peak at layer 0
    working = [50, 10, 10, 10]
    assert recompute_peak(40, working, 0) == (160, 0, 3)  # large inputs: at the top, all four stored
    # Two layers offloaded: the top layer keeps two inputs and one upload is on its way.
    assert recompute_peak(40, working, 2) == (80, 40, 3)
    # The count is the fewest that fits (one offloaded layer only adds an upload buffer).
    assert offload_layers_needed(0, 40, working, budget=170) == 0
    assert offload_layers_needed(0, 40, working, budget=130) == 2


def test_plan_kernel_constants_are_the_kernels_own():
    from genolong.kernels.indexer import topk as indexer_topk
    from genolong.train import plan

    assert plan.INDEXER_GROUP == indexer_topk.GROUP
    assert plan.INDEXER_V2_GROUP == indexer_topk.V2_GROUP
    assert plan.INDEXER_BUDGET == indexer_topk.BUDGET_BYTES


# --------------------------------------------------------------- CPU runs, advice, exit codes


def test_cpu_plan_counts_fp32_weights_and_every_layer_input_in_ram():
    config = get_preset("glm53-mini")
    est = estimate_cpu_memory(config, 4096, MemoryOptions(), ram_bytes=1024 * GIB)
    params = static_bytes(config, dtype_bytes=4)
    assert est.device == "cpu" and est.host == {}
    # fp32 parameters are their own master: weights + gradients + two moments, 16 bytes each.
    assert params["optimizer state"] == 2 * params["gradients"]
    # Offload would copy into the same RAM: every layer input is counted as kept.
    assert est.gpu["stored layer inputs"] == config.num_layers * 4096 * 4 * config.hidden * 4
    assert est.gpu_bytes == int(1024 * GIB * 0.8) and est.fits


def test_cpu_preflight_refuses_before_allocating_and_names_ram(data, tmp_path):
    from genolong.train import loop
    from tests.train._helpers import tiny_options

    opts = MemoryOptions(offload=False, host_budget_gib=0.001)
    with pytest.raises(GenolongError) as err:
        loop.train(tiny_options(data, tmp_path / "run", seq_len=4096, memory=opts))
    message = str(err.value)
    assert "CPU RAM short" in message and "usable" in message and "--host-budget-gib" in message and "\n" not in message
    assert not (tmp_path / "run").exists()  # refused before the run directory was written


def test_the_default_finetune_on_a_cpu_is_refused_at_once():
    from genolong.train.preflight import preflight_cpu

    # On 24 GiB no length fits glm53-mini's fp32 weights, gradients and moments with activations.
    with pytest.raises(GenolongError, match=r"glm53-mini at 512k tokens does not fit: CPU RAM short: .*more RAM.*a smaller model \(--preset tiny\)"):
        preflight_cpu(get_preset("glm53-mini"), 524288, MemoryOptions(), ram_bytes=24 * GIB)
    with pytest.raises(GenolongError, match=r"CPU RAM short: .* a shorter sequence: --seq \d+k") as err:
        preflight_cpu(get_preset("tiny"), 524288, MemoryOptions(), ram_bytes=4 * GIB)
    # The longest length that fits, to 1k (not just a power-of-two fraction of the asked one); the
    # tiny preset is not told to use the tiny preset.
    import re

    from genolong.train.plan import estimate_cpu_memory

    told = int(re.search(r"--seq (\d+)k", str(err.value)).group(1)) * 1024
    fits = lambda n: estimate_cpu_memory(get_preset("tiny"), n, MemoryOptions(), ram_bytes=4 * GIB).fits  # noqa: E731
    assert fits(told) and not fits(told + 1024) and "--preset tiny" not in str(err.value)


def test_host_only_shortfall_names_host_memory_and_asks_for_host_ram_first():
    from genolong.train.preflight import shortfall

    config = get_preset("glm53-mini")
    opts = MemoryOptions(host_budget_gib=4, keep_sparse="off")  # (off: the offload alone, as recorded)
    est = estimate_memory(config, 524288, opts, 1, H200)
    assert est.fits_gpu and not est.fits_host and est.short == ["pinned host memory"]
    fixes = shortfall(config, 524288, opts, 1, H200)
    assert fixes[0].startswith("more host RAM: --host-budget-gib 24 per GPU")
    # A fixed --offload-layers above what the GPU needs: fewer offloaded layers is the fix.
    fixed = MemoryOptions(offload_layers=40, host_budget_gib=30, keep_sparse="off")
    assert any(f.startswith("fewer offloaded layers: --offload-layers 12") for f in shortfall(config, 524288, fixed, 1, H200))


def test_plan_exits_3_when_it_does_not_fit_and_names_the_short_resource():
    from genolong.cli import app

    # (--tile off: 64k tiles would fit 512k without offloading a layer)
    host = CliRunner().invoke(app, ["plan", "--seq", "512k", "--preset", "glm53-mini", "--host-budget-gib", "4", "--tile", "off"])
    assert host.exit_code == 3, host.output
    assert "does not fit: pinned host memory short" in host.output and "more host RAM" in host.output
    gpu = CliRunner().invoke(app, ["plan", "--seq", "1M", "--preset", "glm-5.3-flash", "--host-budget-gib", "4096"])
    assert gpu.exit_code == 3 and "does not fit: GPU memory short" in gpu.output and "--gpus" in gpu.output
    cpu = CliRunner().invoke(app, ["plan", "--seq", "512k", "--device", "cpu", "--host-budget-gib", "20"])
    assert cpu.exit_code == 3 and "does not fit: CPU RAM short" in cpu.output and "RAM" in cpu.output
    fits = CliRunner().invoke(app, ["plan", "--seq", "4k", "--preset", "tiny", "--device", "cpu", "--host-budget-gib", "20"])
    assert fits.exit_code == 0 and "fits" in fits.output


def test_plan_batch_means_sequences_per_step_as_in_finetune():
    from genolong.cli import app

    def total(*args):
        out = CliRunner().invoke(app, ["plan", "--seq", "32k", "--preset", "tiny", "--device", "cpu", *args]).output
        return [line for line in out.splitlines() if "total" in line][0]

    # 4 sequences in 4 micro-batches use the memory of one sequence; in 1 micro-batch, of four.
    assert total("--batch", "4", "--grad-accum", "4") == total()
    assert total("--batch", "4") != total()


def test_cpu_plan_reads_the_node_ram_it_is_given():
    from genolong.cli import app

    # 128k of glm53-mini on a CPU needs ~320 GiB: a 4 TiB machine fits it, a 1 GiB one does not,
    # whatever this machine has.
    args = ["plan", "--seq", "128k", "--preset", "glm53-mini", "--device", "cpu"]
    big = CliRunner().invoke(app, [*args, "--node-ram-gib", "4096"])
    assert big.exit_code == 0 and "fits" in big.output, big.output
    small = CliRunner().invoke(app, [*args, "--node-ram-gib", "1"])
    assert small.exit_code == 3 and "does not fit" in small.output, small.output


@pytest.mark.parametrize(
    "args, named",
    [
        (["--gpu-type", "nan"], "--gpu-type"),
        (["--gpu-type", "inf"], "--gpu-type"),
        (["--node-ram-gib", "inf"], "--node-ram-gib"),
        (["--gpu-budget-gib", "inf"], "--gpu-budget-gib"),
        (["--host-budget-gib", "nan"], "--host-budget-gib"),
        (["--moe-skew", "nan"], "--moe-skew"),
        (["--grad-accum", "0"], "--grad-accum must be at least 1"),
        (["--gpu-gib", "0"], "--gpu-gib"),
        (["--offload-layers", "46"], "--offload-layers 46: the model has 45 layers"),
    ],
)
def test_plan_refuses_non_finite_and_non_positive_sizes_in_one_line(args, named):
    from genolong.cli import app

    from genolong.errors import GenolongError

    # A GenolongError is what the entry point prints as one line with exit code 2 (not a traceback).
    result = CliRunner().invoke(app, ["plan", "--seq", "128k", "--preset", "glm53-mini", *args])
    assert isinstance(result.exception, GenolongError), result.output
    assert named in str(result.exception)


def test_plan_says_which_gpu_it_assumes_on_a_machine_without_one(monkeypatch):
    from genolong.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["plan", "--seq", "32k", "--preset", "glm53-mini"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("no GPU here: planned for an H200 (") and "--gpu-type h100" in result.output
    named = CliRunner().invoke(app, [*args, "--gpu-type", "h200"])
    assert named.exit_code == 0 and "no GPU here" not in named.output
    cpu = CliRunner().invoke(app, ["plan", "--seq", "1k", "--preset", "tiny", "--device", "cpu"])
    assert cpu.exit_code == 0 and "no GPU here" not in cpu.output
