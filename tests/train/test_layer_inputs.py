"""fp8 storage of the saved layer inputs (`--layer-inputs fp8`: genolong.train.fp8_rows and the storage
mode of genolong.train.offload): the quantization's error bound, the offloader's round trip and pool,
a tiny-model step (loss unchanged, gradients close, the stored bytes really smaller), the plan's items,
the pre-flight's suggestion and the flags. The tiled case is in tests/train/test_tiling.py."""

import gc

import pytest
import torch
from typer.testing import CliRunner

from genolong.cli import app
from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.train.fp8_rows import dequantize_rows, pack_fp8, packed_nbytes, quantize_rows, unpack_fp8
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.offload import HostOffloader
from genolong.train.options import MemoryOptions, TrainOptions
from genolong.train.wrapper import ModuleWrapper, wrap
from genolong.train.plan import GIB, H200_BYTES, estimate_memory
from genolong.vocab import N_ID

FP8 = torch.float8_e4m3fn


def _rows_of_every_kind(dtype):
    """[6, 5, 4, 64]: rows from 1e-6 to 1e6 in size, a zero row, an all-negative row, and a row whose
    elements span 10 decades (its small ones fall to e4m3's subnormals)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 4, 64, generator=g) * torch.logspace(-6, 6, 6).view(6, 1, 1, 1)
    x[0, 0, 0] = 0
    x[1, 1, 1] = -x[1, 1, 1].abs()
    x[2, 2, 2] = torch.logspace(-10, 0, 64) * torch.sign(torch.randn(64, generator=g))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_come_back_within_e4m3s_rounding(dtype):
    x = _rows_of_every_kind(dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (*x.shape[:-1], 1)
    back = dequantize_rows(q, scale, dtype)
    assert back.dtype == dtype and back.shape == x.shape
    xf, bf = x.float(), back.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # y = x / s with s = amax / 448 lies in [-448, 448]. e4m3 keeps 3 mantissa bits: a normal y (|y| >= 2^-6)
    # rounds to within half its spacing, 2^-4 |y|; a subnormal one to within half of 2^-9. Back in x's
    # units (times s) and cast to x's dtype (relative rounding u: 2^-8 for bf16, 2^-24 for fp32):
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    bound = torch.maximum(2.0**-4 * xf.abs(), 2.0**-10 * amax / 448) + u * bf.abs()
    err = (bf - xf).abs()
    assert (err <= bound * (1 + 1e-5)).all(), f"worst {(err / bound).max():.4f} of the bound"
    # The coarse form: within 2^-4 of each row's largest magnitude.
    assert (err <= amax * (2.0**-4 + 2 * u)).all()
    assert err.max() > 0  # (it is lossy: the bound, not equality, is what holds)
    # A zero row: scale 1, exact zeros back (no 0/0).
    assert scale[0, 0, 0].item() == 1.0 and torch.equal(back[0, 0, 0], torch.zeros_like(back[0, 0, 0]))
    # An all-negative row stays negative, and its largest magnitude maps to e4m3's 448 (exact, up to the cast).
    assert (back[1, 1, 1] < 0).all()
    assert q[1, 1, 1].float().abs().max().item() == 448.0
    assert bf[1, 1, 1].abs().max().item() == pytest.approx(amax[1, 1, 1].item(), rel=2 * u + 1e-6)


def test_packing_is_scales_then_values_and_round_trips():
    x = _rows_of_every_kind(torch.bfloat16)
    packed = pack_fp8(x)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(x.shape) == 6 * 5 * 4 * (64 + 4)
    q, scale = quantize_rows(x)
    assert torch.equal(packed[: 6 * 5 * 4 * 4].view(torch.float32), scale.flatten())
    assert torch.equal(unpack_fp8(packed, x.shape, x.dtype), dequantize_rows(q, scale, x.dtype))


def test_fp8_offload_returns_the_dequantized_copy_and_frees_its_buffer():
    off = HostOffloader(layers=[0], min_bytes=0, storage="fp8")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 50, 4, 16).to(dtype)
        expected = dequantize_rows(*quantize_rows(x), dtype)
        saved = off._pack(x, 0, True)
        assert off.pinned_bytes() == 3 * 50 * 4 * (16 + 4)  # fp8 bytes + one fp32 scale a row, whatever the dtype
        x.add_(1.0)  # the tensor changes after packing; the stored copy must not
        back = off._unpack(saved)
        assert back.dtype == dtype and torch.equal(back, expected)
        assert back.untyped_storage().data_ptr() != saved.buffer.data.untyped_storage().data_ptr()
        del saved, back
        gc.collect()
        assert off.pinned_bytes() == 0
    assert off.reserved_bytes() == 3 * 50 * 4 * (16 + 4)  # one buffer, reused for both dtypes
    assert off.stats.quantized == 2 and off.stats.bytes_down == 2 * 3 * 50 * 4 * 20


def test_fp8_storage_keeps_on_the_device_too_and_leaves_everything_else_exact():
    off = HostOffloader(layers=[], min_bytes=1024, storage="fp8")
    x = torch.randn(2, 40, 4, 16)
    kept = off._pack(x, 3, False)
    assert kept.tensor.dtype == torch.uint8 and kept.tensor.numel() == 2 * 40 * 4 * 20
    assert torch.equal(off._unpack(kept), dequantize_rows(*quantize_rows(x), x.dtype))
    # Not layer inputs, or not worth it: returned as they are.
    weight = torch.nn.Parameter(torch.randn(64, 64))
    for t in (weight, torch.randn(8, 16), torch.arange(4096).view(64, 64)):
        assert off._unpack(off._pack(t, 3, False)) is t
    # A parked result (genolong.train.keep) stays exact in fp8 storage.
    parked = HostOffloader(layers=[0], min_bytes=0, storage="fp8")
    y = torch.randn(2, 40, 4, 16)
    assert torch.equal(parked.take(parked.park(y, 0)), y) and parked.stats.quantized == 0
    with pytest.raises(GenolongError, match="storage must be one of bf16, fp8"):
        HostOffloader(storage="fp16")


T = 64


def _step(layer_inputs, offload_layers=2, seed=1):
    """One forward + backward of the tiny model (fp32, CPU reference ops) with MoE chunks of 24 tokens
    -> (loss, {name: grad}, handle)."""
    config = get_preset("tiny")
    torch.manual_seed(0)
    model = GenoLongForCausalLM(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=offload_layers, moe_chunk_tokens=24, layer_inputs=layer_inputs))
    ids = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(seed))
    targets = ids[:, 1:]
    loss = chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, targets, targets != N_ID, 64)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, handle


def test_fp8_storage_leaves_the_loss_and_moves_the_gradients_a_little():
    config = get_preset("tiny")
    loss_a, grads_a, exact = _step("bf16")
    loss_b, grads_b, fp8 = _step("fp8")
    # The forward runs on the exact inputs; only backward's recompute reads the stored ones.
    assert torch.equal(loss_a, loss_b)
    ga = torch.cat([grads_a[n].flatten() for n in grads_a])
    gb = torch.cat([grads_b[n].flatten() for n in grads_a])
    rel = ((ga - gb).norm() / ga.norm()).item()
    # Each stored element is within 2^-4 (6%) of itself, ~2% on average; the gradient, a smooth function
    # of the recomputed activations, moves by a few percent (3.8-4.1% over three seeds). A tenth is the
    # bound, with the direction kept (cosine 0.999 measured).
    assert 1e-4 < rel < 0.1, rel
    assert torch.nn.functional.cosine_similarity(ga, gb, dim=0).item() > 0.99
    # The flag did something: every layer's input stored in fp8, the two offloaded ones at 1 byte an
    # element + 4 a row of hidden where fp32 takes 4 bytes an element.
    rows = T * config.mhc.num_streams
    assert fp8.stats.quantized == config.num_layers and fp8.stats.quantized_bytes == config.num_layers * rows * (config.hidden + 4)
    assert exact.stats.bytes_down == 2 * rows * config.hidden * 4
    assert fp8.stats.bytes_down == 2 * rows * (config.hidden + 4)
    assert fp8.pinned_bytes() == 0 and fp8.offloader.live_entries() == 0 and fp8.reserved_bytes() == fp8.stats.bytes_down
    text = str(fp8.model)
    assert "layer 0: input to host memory (fp8 e4m3 with per-row scales, pinned)" in text
    assert "layer 2: input kept on the device (fp8 e4m3 with per-row scales)" in text
    # The recompute routes with the forward's choice of experts (kept on the device), only under fp8 storage.
    assert "moe_topk" in text and "moe_topk" not in str(exact.model)
    assert fp8.describe()["layer_inputs"] == "fp8" and exact.describe()["layer_inputs"] == "bf16"
    fp8.remove()
    assert "moe_topk" not in str(fp8.model) and "Offload(" not in str(fp8.model)


def _routed_step(**memory):
    """A tiny-model step under fp8 storage recording every router call: {(layer, "forward" / "backward"):
    [(the experts it returned, the experts its input picks freely)]}, the handle."""
    from genolong.model.moe import Router

    config = get_preset("tiny")
    torch.manual_seed(0)
    model = GenoLongForCausalLM(config)
    handle = apply_memory_optimizations(model, MemoryOptions(layer_inputs="fp8", **memory))
    seen = {}

    def hook(router, inputs, out):
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        with torch.no_grad():
            free = router.route(inputs[0].detach())[0]
        seen.setdefault((router.layer_idx, phase), []).append((out[0].clone(), free))

    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(hook)
    ids = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:]
    chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, targets, targets != N_ID, 64).backward()
    return seen, handle


def test_fp8_recompute_routes_with_the_forwards_choice_where_the_rebuilt_input_picks_others():
    seen, handle = _routed_step(offload_layers=2, moe_chunk_tokens=24)
    layers = sorted({layer for layer, _ in seen})
    assert layers and handle.keep.stats.replayed > 0
    flips = 0
    for layer in layers:
        forward = [out for out, _ in seen[(layer, "forward")]]
        backward = seen[(layer, "backward")]
        # The layer's recompute runs the three chunks, then each chunk's own checkpoint recomputes it (last first).
        assert len(backward) == 2 * len(forward) == 6
        for out, want in zip([o for o, _ in backward], forward + forward[::-1]):
            assert torch.equal(out, want)
        flips += sum((~(o.sort(-1).values == f.sort(-1).values).all(-1)).sum().item() for (_, f), o in zip(backward, forward + forward[::-1]))
    # The case the replay exists for: on its rebuilt input the router would have picked other experts.
    assert flips > 0


def test_fp8_tiled_recompute_routes_with_the_forwards_choice():
    seen, handle = _routed_step(offload_layers=1, tile_tokens=32, keep_sparse="off")
    layers = sorted({layer for layer, _ in seen})
    assert layers and handle.keep.stats.replayed > 0 and handle.tile_tokens() == 32
    for layer in layers:
        forward = sorted(out.numpy().tobytes() for out, _ in seen[(layer, "forward")])
        backward = sorted(out.numpy().tobytes() for out, _ in seen[(layer, "backward")])
        assert len(forward) == 2 and backward == forward


def test_kept_routing_is_stored_in_the_smallest_integer_type():
    from genolong.model.moe import index_dtype

    assert index_dtype(64) == torch.uint8 and index_dtype(256) == torch.uint8
    assert index_dtype(257) == torch.int16 and index_dtype(2**15 + 1) == torch.int32
    _, handle = _routed_step(offload_layers=2, moe_chunk_tokens=24, keep_sparse="off")
    # keep_sparse off: the routing alone is kept, on the device, one byte an expert slot of each token.
    config = get_preset("tiny")
    assert handle.keep.ops == {"moe_topk"} and handle.keep.where == "device"
    moe_layers = len({m.layer_idx for m in handle.model.modules() if type(m).__name__ == "Router"})
    assert handle.keep.stats.bytes_kept == moe_layers * T * config.moe.top_k


def test_fp8_storage_without_offload_keeps_every_input_in_fp8():
    config = get_preset("tiny")
    loss, _, handle = _step("fp8", offload_layers=None)  # offload_layers None on a CPU: nothing offloaded
    assert torch.isfinite(loss) and handle.stats.packed == 0 and handle.stats.quantized == config.num_layers


def _working_layer(est):
    (name,) = [k for k in est.gpu if k.startswith("layer working set")]
    return int(name.rsplit(" ", 1)[1].rstrip(")"))


def test_plan_counts_fp8_bytes_and_scales_for_stored_offloaded_and_uploaded_inputs():
    config = get_preset("glm53-mini")  # hidden 512, 4 streams, 45 layers
    tokens, rows = 131072, 131072 * 4
    plan = lambda **kw: estimate_memory(config, tokens, MemoryOptions(**kw), 1, H200_BYTES, host_bytes=1024 * GIB)  # noqa: E731
    bf16, fp8 = plan(offload_layers=2), plan(offload_layers=2, layer_inputs="fp8")
    assert bf16.host["offloaded layer inputs (pinned)"] == 2 * rows * 512 * 2
    assert fp8.host["offloaded layer inputs (pinned)"] == 2 * rows * (512 + 4)
    for est, per_layer in ((bf16, rows * 512 * 2), (fp8, rows * (512 + 4))):
        at = _working_layer(est)
        assert at >= 2  # the peak is at a layer that keeps its input
        assert est.gpu["stored layer inputs"] == (at + 1 - 2) * per_layer
        assert est.gpu["uploaded layer inputs"] == per_layer  # the next offloaded one, prefetched
    # fp8: the input of the layer being recomputed is rebuilt beside its stored form.
    assert fp8.gpu["rebuilt layer input (fp8 storage)"] == rows * 512 * 2 and "rebuilt layer input (fp8 storage)" not in bf16.gpu
    # The router choices fp8 storage keeps: 4 experts of 64, one byte each, for each of the 42 MoE layers.
    assert len(config.moe_layers) == 42 and (config.moe.num_experts, config.moe.top_k) == (64, 4)
    assert fp8.host["kept router choices (pinned)"] == 42 * tokens * 4 and "kept router choices (pinned)" not in bf16.host
    assert "kept router choices (device)" not in fp8.gpu
    device = plan(offload_layers=2, keep_sparse="off", layer_inputs="fp8")
    assert device.gpu["kept router choices (device)"] == 42 * tokens * 4
    # Tiled, every layer offloaded: a tile's input comes back (its own and the next, prefetched), in fp8.
    tiled = plan(offload_layers=45, tile_tokens=32768, keep_sparse="off", layer_inputs="fp8")
    assert tiled.gpu["uploaded layer inputs"] == 2 * 32768 * 4 * (512 + 4)
    assert tiled.gpu["rebuilt layer input (fp8 storage)"] == 32768 * 4 * 512 * 2


def test_preflight_offers_fp8_layer_inputs_last_when_only_they_fit():
    from genolong.train.preflight import preflight

    # 1.5M on one H200 of a 128 GiB node: bf16 inputs (6 GiB a layer) fit no tile; fp8 ones fit with 256k tiles.
    with pytest.raises(GenolongError) as refused:
        preflight(get_preset("glm53-mini"), 1536 * 1024, MemoryOptions(tile_auto=True), gpu_bytes=H200_BYTES, host_bytes=128 * GIB)
    fixes = str(refused.value).split("it would fit with ", 1)[1].split("; or ")
    fp8 = [i for i, f in enumerate(fixes) if "--layer-inputs fp8" in f]
    assert fp8 and fixes[fp8[0]].endswith("--layer-inputs fp8 (with --tile 256k)")
    assert all("--seq" in f for f in fixes[fp8[0] + 1 :])  # after every other change but a shorter sequence
    est = preflight(get_preset("glm53-mini"), 1536 * 1024, MemoryOptions(tile_auto=True, layer_inputs="fp8"),
                    gpu_bytes=H200_BYTES, host_bytes=128 * GIB)
    assert est.fits and est.opts.tile_tokens == 256 * 1024


@pytest.mark.parametrize("flags, message", [
    (dict(layer_inputs="fp16"), "--layer-inputs must be one of bf16, fp8, got 'fp16'"),
    (dict(layer_inputs="fp8", recompute=False), "--layer-inputs fp8 stores the layer inputs that recompute keeps"),
    (dict(layer_inputs="fp8", baseline=True), "--layer-inputs fp8 stores the layer inputs that recompute keeps"),
])
def test_bad_layer_inputs_are_refused_in_one_line(flags, message):
    base = dict(recompute=True, offload=True, moe_chunk="64k", loss_chunk=None, offload_layers=None, gpu_budget_gib=None,
                host_budget_gib=None, keep_sparse="auto", moe_chunking=True, keep_moe=False, tile="auto")
    baseline = flags.pop("baseline", False)
    with pytest.raises(GenolongError) as refused:
        MemoryOptions.from_flags(baseline, **{**base, **flags})
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_plan_command_takes_the_flag_and_refuses_a_bad_value():
    args = ["plan", "--seq", "1M", "--preset", "glm53-mini", "--node-ram-gib", "128"]
    ok = CliRunner().invoke(app, [*args, "--layer-inputs", "fp8"])
    assert ok.exit_code == 0, ok.output
    assert "layer_inputs=fp8" in ok.output and "rebuilt layer input (fp8 storage)" in ok.output
    # (genolong's entry point prints a GenolongError as one line; the app invoked here raises it)
    bad = CliRunner().invoke(app, [*args, "--layer-inputs", "int4"])
    assert isinstance(bad.exception, GenolongError) and str(bad.exception) == "--layer-inputs must be one of bf16, fp8, got 'int4'"
    refused = CliRunner().invoke(app, [*args, "--no-recompute", "--layer-inputs", "fp8"])
    assert isinstance(refused.exception, GenolongError) and str(refused.exception).startswith("--layer-inputs fp8 stores")


def test_resume_compares_the_layer_inputs_with_the_runs():
    from genolong.train.resume_flags import _matches

    run = TrainOptions(memory=MemoryOptions(layer_inputs="fp8"))
    assert _matches("layer_inputs", "fp8", run) is True and _matches("layer_inputs", "bf16", run) is False
    assert MemoryOptions.from_dict({k: v for k, v in MemoryOptions().to_dict().items() if k != "layer_inputs"}).layer_inputs == "bf16"


class _ReferenceLayer(ModuleWrapper):
    """What a layer under fp8 storage with router replay computes, by autograd without a checkpoint: the
    value of the layer on its exact input, the gradient of the layer on the fp8-rebuilt input with each
    router held to the experts the exact run chose."""

    def __init__(self, layer, routers) -> None:
        super().__init__(layer)
        self.routers = routers
        self.flips = 0

    def forward(self, streams, *args):
        chosen = {}
        hooks = [r.register_forward_hook(lambda r, i, out: chosen.setdefault(r, []).append(out[0])) for r in self.routers]
        with torch.no_grad():
            exact = self.wrapped(streams, *args)
        for h in hooks:
            h.remove()
        rebuilt = unpack_fp8(pack_fp8(streams.detach()), streams.shape, streams.dtype)
        for r in self.routers:
            def held(x, r=r):
                want = chosen[r].pop(0)
                with torch.no_grad():
                    self.flips += int((~(r.route(x)[0].sort(-1).values == want.sort(-1).values).all(-1)).sum())
                return r.route(x, top_indices=lambda choice, k: want)
            r.forward = held
        try:
            approx = self.wrapped(streams + (rebuilt - streams).detach(), *args)
        finally:
            for r in self.routers:
                del r.forward
        if isinstance(exact, tuple):
            return (approx[0] + (exact[0] - approx[0]).detach(), *exact[1:])
        return approx + (exact - approx).detach()


def test_fp8_backward_differentiates_the_forwards_routing_on_the_rebuilt_input():
    from genolong.model.moe import Router
    from genolong.train.recompute import decoder_body

    config = get_preset("tiny")
    ids = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:]

    def step(prepare):
        torch.manual_seed(0)
        model = GenoLongForCausalLM(config)
        params = list(model.parameters())
        extra = prepare(model)
        loss = chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, targets, targets != N_ID, 64)
        loss.backward()
        return loss.detach(), [p.grad for p in params], extra

    def reference(model):
        body = decoder_body(model)
        wrapped = []
        for i, layer in enumerate(body.layers):
            wrapped.append(wrap(body.layers, str(i), _ReferenceLayer, [m for m in layer.modules() if isinstance(m, Router)]))
        return wrapped

    opts = MemoryOptions(offload_layers=None, keep_sparse="off", moe_chunking=False, layer_inputs="fp8")
    loss, grads, handle = step(lambda model: apply_memory_optimizations(model, opts))
    loss_ref, grads_ref, wrapped = step(reference)
    assert handle.keep.stats.replayed > 0 and handle.stats.quantized == config.num_layers
    # The rebuilt input routes some token elsewhere: following the recompute's choice would change the gradient.
    assert sum(w.flips for w in wrapped) > 0
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=0)
    for g, want in zip(grads, grads_ref):
        assert (g is None) == (want is None)
        if g is not None:
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
