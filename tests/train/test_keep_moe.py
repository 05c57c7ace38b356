"""The MoE outputs kept for the recompute (genolong.train.keep_moe, MemoryOptions.keep_moe): the layer's
recompute takes the chunked MoE's output from the forward, the MoE runs twice a step instead of three
times, and the gradients are those of the chunk checkpoint; on the CPU `tiny` model."""

import gc

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.model.config import MLP_MOE
from genolong.model.moe import MoE
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.options import MemoryOptions
from genolong.vocab import N_ID

T = 96
CHUNK = 32  # three MoE chunks a layer


@pytest.fixture(scope="module")
def config():
    return get_preset("tiny", dsa={"indexer": {"topk": 16}})


def _n_moe(config):
    return sum(1 for kind in config.mlp_types if kind == MLP_MOE)


def _run(config, opts, batch=1):
    """(loss, gradients, MoE module calls in the forward, in the whole step, the memory handle, pinned bytes after backward)."""
    torch.manual_seed(0)
    model = GenoLongForCausalLM(config)
    calls = [0]
    for module in model.modules():
        if isinstance(module, MoE):
            module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    handle = apply_memory_optimizations(model, opts)
    if handle.offloader is not None:
        handle.offloader.min_bytes = 0  # park everything, however small (tiny's tensors are)
    ids = torch.randint(0, 5, (batch, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss = chunked_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, targets != N_ID, 64)
    forward_calls = calls[0]
    loss.backward()
    del inputs
    gc.collect()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, forward_calls, calls[0], handle, handle.pinned_bytes()


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("where", ["device", "host"])
def test_kept_moe_outputs_skip_the_recompute_with_the_chunk_checkpoints_gradients(config, where):
    n_moe = _n_moe(config)
    assert n_moe >= 1
    chunks = -(-T // CHUNK)
    base = dict(moe_chunk_tokens=CHUNK, keep_sparse="off")
    place = dict(offload_layers=1) if where == "host" else dict(offload=False)
    loss0, plain, fwd0, total0, _, _ = _run(config, MemoryOptions(**base, **place))
    assert (fwd0, total0) == (n_moe * chunks, 3 * n_moe * chunks)  # forward, the layer's recompute, the chunks' own

    keep = dict(base, keep_moe=True, **({"keep_sparse": "host"} if where == "host" else {}))
    loss, grads, fwd, total, handle, pinned_after = _run(config, MemoryOptions(**keep, **place))
    assert (fwd, total) == (n_moe * chunks, 2 * n_moe * chunks)  # the recompute took the kept output
    assert handle.keep.where == where and handle.describe()["keep_moe"] == where
    assert handle.describe()["keep_sparse"] == ("host" if where == "host" else "off")
    n_kept_moe = handle.keep.stats.replayed - (2 * sum(1 for k in config.layer_types if k != "kda") if where == "host" else 0)
    assert n_kept_moe == n_moe
    if where == "host":
        assert pinned_after == 0  # every parked output back in the pool after backward
    assert torch.equal(loss, loss0)  # the forward's output is the MoE's own
    assert grads.keys() == plain.keys()
    for name in plain:
        assert _rel(grads[name], plain[name]) < 1e-5, name


def test_a_moe_of_one_chunk_is_not_kept(config):
    """At most one chunk the MoE runs as a plain module (no chunk checkpoint, nothing to save a run of)."""
    opts = MemoryOptions(offload=False, keep_sparse="off", moe_chunk_tokens=T, keep_moe=True)
    _, _, fwd, total, handle, _ = _run(config, opts)
    assert (fwd, total) == (_n_moe(config), 2 * _n_moe(config))
    assert handle.keep.stats.recorded == 0


def test_a_retained_graph_runs_the_moe_again_from_the_kept_output(config):
    torch.manual_seed(0)
    model = GenoLongForCausalLM(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunk_tokens=CHUNK, keep_moe=True))
    ids = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(1))
    loss = chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, ids[:, 1:], ids[:, 1:] != N_ID, 64)
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loss.backward()
    for name, g in once.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, 2 * g, rtol=1e-5, atol=1e-8, msg=name)
    assert handle.keep.stats.replayed == 2 * handle.keep.stats.recorded
    handle.remove()


def test_keep_moe_needs_recompute_and_moe_chunking_in_one_line():
    for opts in (MemoryOptions(recompute=False, offload=False, keep_moe=True), MemoryOptions(moe_chunking=False, keep_moe=True)):
        with pytest.raises(GenolongError, match="--keep-moe .* needs recompute and --moe-chunking; drop --keep-moe") as err:
            opts.validate()
        assert "\n" not in str(err.value)
    assert not MemoryOptions().keeps_moe() and MemoryOptions(keep_moe=True).keeps_moe()
    # Where they wait: with the DSA results, or where keep_sparse auto would put those.
    assert MemoryOptions(keep_moe=True).kept_moe_where() == "host" and MemoryOptions().kept_moe_where() is None
    assert MemoryOptions(keep_moe=True, keep_sparse="device").kept_moe_where() == "device"
    assert MemoryOptions(keep_moe=True, keep_sparse="off", offload=False).kept_moe_where() == "device"
    assert MemoryOptions(keep_moe=True, keep_sparse="off").kept_moe_where() == "host"
    assert MemoryOptions.from_dict({k: v for k, v in MemoryOptions().to_dict().items() if k != "keep_moe"}).keep_moe is False  # older runs


def test_the_plan_counts_the_kept_moe_outputs():
    from genolong.train.plan import estimate_memory
    from genolong.train.preflight import shortfall

    mini = get_preset("glm53-mini")
    n_moe, seq = _n_moe(mini), 131072
    off = estimate_memory(mini, seq, MemoryOptions())
    kept = estimate_memory(mini, seq, MemoryOptions(keep_moe=True))
    per_layer = 2 * mini.hidden * seq
    assert kept.host["kept MoE outputs (pinned)"] == n_moe * per_layer
    assert kept.host["kept DSA results (pinned)"] == off.host["kept DSA results (pinned)"]
    in_flight = kept.gpu["kept DSA results and MoE outputs in flight (2 layers)"]
    assert in_flight - off.gpu["kept DSA results in flight (2 layers)"] == 2 * per_layer  # every DSA layer of glm53-mini has a MoE
    # Nothing is kept where the MoE runs as one chunk; on the GPU with keep_sparse off and no offload.
    short = estimate_memory(mini, 65536, MemoryOptions(keep_moe=True))
    assert "kept MoE outputs (pinned)" not in short.host
    device = estimate_memory(mini, seq, MemoryOptions(offload=False, keep_sparse="off", keep_moe=True))
    assert device.gpu["kept MoE outputs (device)"] == n_moe * per_layer and "kept DSA results (device)" not in device.gpu
    # A GPU that fits the step only without the kept outputs is told to drop them.
    tight = MemoryOptions(offload=False, keep_sparse="off", keep_moe=True)
    budget = estimate_memory(mini, seq, MemoryOptions(offload=False, keep_sparse="off")).gpu_total + per_layer
    fixes = shortfall(mini, seq, MemoryOptions.from_dict({**tight.to_dict(), "gpu_budget_gib": budget / 2**30}), 1, 141 << 30)
    assert "the MoE outputs recomputed, not kept: drop --keep-moe" in fixes
