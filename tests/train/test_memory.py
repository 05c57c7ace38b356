"""Recompute, offload, MoE chunking and the mHC switch on the CPU `tiny` model (genolong.train.memory):
the passes' wrappers, visible in print(model), with the plain model's keys and names."""

import gc
import warnings

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.train.census import saved_bytes
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.memory import ChunkedMoE, Fp32InputMHC
from genolong.train.offload import HostOffloader, Offload
from genolong.train.options import MemoryOptions
from genolong.train.recompute import Recompute
from genolong.vocab import N_ID

T = 64


@pytest.fixture(scope="module")
def config():
    return get_preset("tiny")


def _model(config, seed=0):
    torch.manual_seed(seed)
    return GenoLongForCausalLM(config)


def _tokens(seed=1, n=T + 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (1, n), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss_and_grads(model, seed=1):
    model.zero_grad(set_to_none=True)
    inputs, targets = _tokens(seed)
    hidden = model.hidden_states(inputs)
    loss = chunked_lm_loss(hidden, model.lm_head.weight, targets, targets != N_ID, 64)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(a, b, atol=0.0):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b) if atol == 0 else torch.allclose(loss_a, loss_b, atol=atol, rtol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=0 if atol == 0 else 1e-5, msg=name)


def test_recompute_gives_identical_loss_and_grads(config):
    model = _model(config)
    plain = _loss_and_grads(model)
    # keep_sparse off: the recompute runs exactly the forward's ops (tests/train/test_keep.py: kept).
    handle = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunking=False, keep_sparse="off"))
    recomputed = _loss_and_grads(model)
    assert handle.recompute_calls() == config.num_layers  # the wrappers really ran every layer
    _assert_same(plain, recomputed)
    handle.remove()
    assert not any(isinstance(m, Recompute) for m in model.modules())


def test_full_stack_matches_plain_and_keeps_state_dict_keys(config):
    model = _model(config)
    keys = list(model.state_dict())
    plain = _loss_and_grads(model)
    opts = MemoryOptions(offload_layers=config.num_layers, moe_chunk_tokens=24)
    names = [n for n, _ in model.named_parameters()]
    handle = apply_memory_optimizations(model, opts)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    optimized = _loss_and_grads(model)
    # MoE chunks sum the same per-token terms; only fp32 rounding of the chunked cat may differ.
    _assert_same(plain, optimized, atol=1e-6)
    assert handle.stats.packed == config.num_layers and handle.stats.unpacked == config.num_layers
    handle.remove()
    assert _loss_and_grads(model)[0] == plain[0]


def test_offload_round_trip_is_exact_and_uses_the_host_copy():
    off = HostOffloader(layers=[0], min_bytes=0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(3, 50, 4, 16).to(dtype)
        expected = x.clone()
        saved = off._pack(x, 0, True)
        assert off.pinned_bytes() == x.numel() * x.element_size()
        x.add_(1.0)  # the device tensor changes after packing; the host copy must not
        back = off._unpack(saved)
        assert back.dtype == dtype and back.shape == expected.shape
        assert torch.equal(back, expected)
        assert back.untyped_storage().data_ptr() != saved.buffer.data.untyped_storage().data_ptr()
        del saved, back
        gc.collect()
        assert off.pinned_bytes() == 0


def test_offload_pool_is_reused_and_freed_every_step(config):
    model = _model(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=3, moe_chunking=False))
    reserved = []
    for step in range(3):
        inputs, targets = _tokens(seed=step)
        hidden = model.hidden_states(inputs)
        layer_input = T * config.mhc.num_streams * config.hidden * 4
        assert handle.pinned_bytes() == 3 * layer_input  # three layer inputs live on the host
        loss = chunked_lm_loss(hidden, model.lm_head.weight, targets, targets != N_ID, 64)
        loss.backward()
        del hidden, loss
        assert handle.pinned_bytes() == 0, f"step {step}: offloaded bytes not freed after backward"
        assert handle.offloader.live_entries() == 0
        reserved.append(handle.reserved_bytes())
        model.zero_grad(set_to_none=True)
    assert reserved[0] == reserved[1] == reserved[2] == 3 * T * config.mhc.num_streams * config.hidden * 4
    assert handle.stats.prefetch_hits == 0  # prefetch needs CUDA streams; CPU copies in place
    handle.remove()
    assert handle.reserved_bytes() == 0


def test_offload_hooks_prefetch_in_backward_order():
    """Unpacking layer i starts the upload of the nearest earlier offloaded layer (CUDA path
    only uploads; here the order is checked through the entries the offloader would fetch)."""
    off = HostOffloader(layers=[0, 2], min_bytes=0)
    entries = [off._pack(torch.randn(8, 4), i, off.offloads(i)) for i in range(4)]
    fetched = []
    off._upload = lambda saved: fetched.append(saved.layer_idx) or setattr(saved, "uploaded", True)

    def cuda_like(entry):
        entry.device = torch.device("cuda")  # only the prefetch decision looks at the device here

    for e in entries:
        if hasattr(e, "layer_idx"):
            cuda_like(e)
    off._prefetch_before(entries[3].order)
    off._prefetch_before(entries[2].order)
    assert fetched == [2, 0]


def _live_tensor_bytes() -> int:
    gc.collect()
    total, seen = 0, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes warns
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if not isinstance(obj, torch.nn.Parameter):
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except Exception:  # meta / sparse tensors without a storage
            continue
    return total


def _census_over_steps(model, steps=3):
    from genolong.train.optim import MasterAdamW

    opt = MasterAdamW(list(model.named_parameters()), lr=1e-3)
    sizes = []
    for step in range(steps):
        loss, _ = _loss_and_grads(model, seed=step)
        opt.step(1e-3, 1.0)
        opt.zero_grad()
        del loss, _
        sizes.append(_live_tensor_bytes())
    return sizes


def test_memory_does_not_grow_from_step_to_step(config):
    model = _model(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=2, moe_chunk_tokens=24))
    sizes = _census_over_steps(model)
    assert sizes[1] == sizes[2], sizes
    handle.remove()


def test_step_census_catches_a_leak(config):
    """The census above can fail: a module that keeps its router output across steps (the seed's
    router-probability leak) makes it grow."""
    model = _model(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunking=False))
    kept = []
    gate = next(m for m in model.modules() if type(m).__name__ == "Router")
    hook = gate.register_forward_hook(lambda _m, _i, out: kept.append(out))
    sizes = _census_over_steps(model)
    hook.remove()
    assert sizes[2] > sizes[1] > sizes[0]
    handle.remove()


def test_moe_chunking_saves_less_for_backward(config):
    """With checkpointed chunks the MoE keeps only its chunk inputs, so the layer saves less."""
    model = _model(config)
    moe_layer = config.moe_layers[0]
    layer = model.model.layers[moe_layer]
    streams = torch.randn(1, T, config.mhc.num_streams, config.hidden)

    plain_bytes, plain_out = saved_bytes(lambda: layer(streams))
    handle = apply_memory_optimizations(model, MemoryOptions(recompute=False, offload=False, moe_chunk_tokens=32))
    chunked_bytes, chunked_out = saved_bytes(lambda: layer(streams))
    handle.remove()
    torch.testing.assert_close(chunked_out, plain_out, atol=1e-6, rtol=1e-5)
    assert chunked_bytes < plain_bytes


def test_mhc_fp32_input_switch_keeps_an_fp32_copy(config):
    model = GenoLongForCausalLM(config, dtype=torch.bfloat16)
    streams = torch.randn(1, T, config.mhc.num_streams, config.hidden, dtype=torch.bfloat16, requires_grad=True)

    def fp32_saved():
        found = []

        def pack(t):
            if t.dtype == torch.float32 and t.dim() and t.shape[-1] == config.mhc.num_streams * config.hidden:
                found.append(t.shape)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model.layers[0].attn_hc(streams)  # the module in the model: the wrapper, when the switch is on
        return found

    assert fp32_saved() == []  # genolong.model.mhc never keeps one
    handle = apply_memory_optimizations(model, MemoryOptions.baseline())
    assert fp32_saved(), "the baseline switch should put the fp32 input copy back"
    handle.remove()
    assert fp32_saved() == []


def test_offload_without_recompute_is_refused():
    with pytest.raises(GenolongError, match="--offload needs recompute"):
        apply_memory_optimizations(torch.nn.Linear(2, 2), MemoryOptions(recompute=False, offload=True))


def test_budgeted_offload_is_a_no_op_on_cpu(config):
    model = _model(config)
    handle = apply_memory_optimizations(model, MemoryOptions())  # offload_layers None: from the budget
    _loss_and_grads(model)
    assert handle.offload_layers() == [] and handle.stats.packed == 0
    handle.remove()


def test_recompute_skips_checkpoint_without_grad():
    wrapper = Recompute(torch.nn.Linear(4, 4))
    with torch.no_grad():
        wrapper(torch.randn(2, 4))
    assert wrapper.calls == 0


def test_passes_show_in_print_and_keep_keys_names_and_loading(config):
    model = _model(config)
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=1, moe_chunk_tokens=24, mhc_low_precision=False))
    text = str(model)
    layers = config.num_layers
    assert text.count("Offload(") == layers and text.count("Recompute(") == layers
    assert text.count("ChunkedMoE(") == len(config.moe_layers) and text.count("Fp32InputMHC(") == 2 * layers
    assert "layer 0: input to host memory" in text and "layer 1: input kept on the device" in text
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in _model(config).named_buffers()]
    # Loading the plain keys reaches the wrapped parameters (strict: nothing missing, nothing unexpected).
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in keys)
    # Attribute access and get_submodule see through the wrappers; the layer loop needs both.
    moe_layer = config.moe_layers[0]
    assert isinstance(model.model.layers[moe_layer].mlp, ChunkedMoE) and model.model.layers[moe_layer].mlp.experts is not None
    assert model.get_submodule(f"model.layers.{moe_layer}.mlp.experts") is model.model.layers[moe_layer].mlp.experts
    assert isinstance(model.model.layers[0], Offload) and model.model.layers[0].emits_topk is False
    assert isinstance(model.model.layers[0].attn_hc, Fp32InputMHC)
    handle.remove()
    assert str(model) == str(_model(config))


@pytest.mark.gpu
def test_offload_on_cuda_streams_round_trips_and_matches_plain():
    """The CUDA path: pinned pool, side streams, prefetch; gradients equal to no offload."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)).cuda()
    x = torch.randn(4, 2048, 256, device="cuda")

    def run(wrapped):
        layers.zero_grad(set_to_none=True)
        h = x * 1.0
        for layer in wrapped:
            h = layer(h)
        h.square().mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    plain = run(layers)
    off = HostOffloader(layers=[0, 1, 2, 4])
    wrapped = [Offload(Recompute(layer), off, i) for i, layer in enumerate(layers)]
    for _ in range(3):
        got = run(wrapped)
        for a, b in zip(plain, got):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert off.pinned_bytes() == 0
    assert off.stats.prefetch_hits >= 2  # layers 2 and 1 (and 0) were uploaded ahead of their unpack
    assert all(b.pinned for b in off._all)
    reserved = off.reserved_bytes()
    run(wrapped)
    assert off.reserved_bytes() == reserved == 4 * x.numel() * 4
    off.release()


def test_memory_flags_baseline_keeps_only_sizes_and_no_recompute_drops_offload():
    # The flags finetune and plan share: --baseline turns every switch off whatever else was
    # given but keeps the sizes and budgets; --no-recompute takes offload with it.
    flags = dict(recompute=True, offload=True, moe_chunk="32k", loss_chunk="4k", offload_layers=3,
                 gpu_budget_gib=70.0, host_budget_gib=100.0, keep_sparse="host", moe_chunking=True, keep_moe=True)
    base = MemoryOptions.from_flags(True, **flags)
    assert (base.recompute, base.offload, base.moe_chunking, base.keep_moe, base.chunked_loss, base.keep_sparse) == (False, False, False, False, False, "off")
    assert (base.moe_chunk_tokens, base.loss_chunk_tokens, base.offload_layers, base.gpu_budget_gib, base.host_budget_gib) == (32768, 4096, 3, 70.0, 100.0)
    full = MemoryOptions.from_flags(False, **flags)
    assert (full.recompute, full.offload, full.keep_sparse, full.keep_moe, full.moe_chunk_tokens) == (True, True, "host", True, 32768)
    plain = MemoryOptions.from_flags(False, **{**flags, "recompute": False, "keep_sparse": "off", "keep_moe": False, "loss_chunk": None})
    assert (plain.recompute, plain.offload, plain.loss_chunk_tokens) == (False, False, None)
    with pytest.raises(GenolongError, match="--moe-chunk"):
        MemoryOptions.from_flags(False, **{**flags, "moe_chunk": "lots"})


def test_finetune_and_plan_build_memory_options_from_the_same_parameters():
    import inspect

    from genolong.train.cli import finetune
    from genolong.train.flags import MEMORY as MEMORY_PARAMS
    from genolong.train.flags import memory_options
    from genolong.train.plan_cli import plan

    # memory_options reads these names from each command's parsed parameters: both must have every one.
    for command in (finetune, plan):
        missing = set(MEMORY_PARAMS) - set(inspect.signature(command).parameters)
        assert not missing, f"{command.__name__} lacks {sorted(missing)}"
    params = dict(baseline=False, recompute=True, offload=True, moe_chunk="32k", loss_chunk=None, offload_layers=2,
                  gpu_budget_gib=None, host_budget_gib=8.0, pinned=False, overlap=False, keep_sparse="off",
                  moe_chunking=True, keep_moe=False, mhc_low_precision=False, chunked_loss=True, tile="128k", layer_inputs="fp8", seq="1M")
    opts = memory_options(params, gpu_budget_gib=50.0)
    assert opts.layer_inputs == "fp8"
    assert (opts.offload_pinned, opts.offload_overlap, opts.mhc_low_precision, opts.offload_layers) == (False, False, False, 2)
    assert (opts.tile_tokens, opts.tile_auto) == (131072, False)
    assert (opts.gpu_budget_gib, opts.host_budget_gib, opts.moe_chunk_tokens) == (50.0, 8.0, 32768)
    assert memory_options({**params, "baseline": True, "layer_inputs": "bf16"}).recompute is False

def test_offload_layers_above_the_models_layers_are_refused_not_clamped():
    config = get_preset("tiny")
    model = GenoLongForCausalLM(config)
    with pytest.raises(GenolongError, match=rf"^--offload-layers {config.num_layers + 1}: the model has {config.num_layers} layers"):
        apply_memory_optimizations(model, MemoryOptions(offload_layers=config.num_layers + 1))
    # All of them is fine, and so is any number without offload.
    apply_memory_optimizations(GenoLongForCausalLM(config), MemoryOptions(offload_layers=config.num_layers))
    apply_memory_optimizations(GenoLongForCausalLM(config), MemoryOptions(offload=False, recompute=False, offload_layers=99))

