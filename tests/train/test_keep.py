"""Kept results under recompute (genolong.train.keep): the recompute takes the DSA selection and the
sparse attention from the forward, with the gradients of a full recompute, on the CPU `tiny` model."""

import gc

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, frames, get_preset, ops
from genolong.model.dsa import sparse_attention_reference
from genolong.model.indexer_loss import IndexerLossSwitch
from genolong.model.sparse_replay import sparse_attention_backward_reference, sparse_attention_replay_reference
from genolong.train.keep import KeptResults, ReplayFrame
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.options import MemoryOptions
from genolong.vocab import N_ID

T = 96


@pytest.fixture(scope="module")
def config():
    return get_preset("tiny", dsa={"indexer": {"topk": 16}})  # selections smaller than the context


def _model(config, seed=0):
    torch.manual_seed(seed)
    return GenoLongForCausalLM(config)


def _loss_and_grads(model, seed=1, batch=1):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 5, (batch, T + 1), generator=torch.Generator().manual_seed(seed))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss = chunked_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, targets != N_ID, 64)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def counted(monkeypatch):
    """Counts the reference implementations' calls of the two keepable ops."""
    calls = {"dsa_indexer_topk": 0, "dsa_sparse_attention": 0}
    for op in calls:
        original = ops.implementations(op)[ops.REFERENCE]

        def counting(*args, _op=op, _fn=original, **kwargs):
            calls[_op] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setitem(ops._IMPLS[op], ops.REFERENCE, counting)
    return calls


def _n_dsa(config):
    return sum(1 for kind in config.layer_types if kind != "kda")


def test_kept_results_skip_the_recompute_with_the_same_gradients(config, counted):
    model = _model(config)
    n_dsa = _n_dsa(config)
    assert n_dsa >= 1
    off = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunking=False, keep_sparse="off"))
    plain_loss, plain = _loss_and_grads(model)
    assert counted == {"dsa_indexer_topk": 2 * n_dsa, "dsa_sparse_attention": 2 * n_dsa}  # forward + recompute
    off.remove()
    counted.update({k: 0 for k in counted})

    handle = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunking=False))
    assert handle.keep is not None and handle.keep.where == "device"  # auto, without offload
    assert "keeps dsa_indexer_topk, dsa_sparse_attention (device)" in repr(model)
    loss, grads = _loss_and_grads(model)
    assert counted == {"dsa_indexer_topk": n_dsa, "dsa_sparse_attention": n_dsa}  # the forward's only
    stats = handle.keep.stats
    assert (stats.recorded, stats.replayed, stats.rerun) == (2 * n_dsa, 2 * n_dsa, 0)
    assert torch.equal(loss, plain_loss)  # the forward's result is the op's own
    assert grads.keys() == plain.keys()
    for name in plain:
        # The sparse attention's backward is now computed from (out, lse) instead of by autograd.
        assert _rel(grads[name], plain[name]) < 1e-5, name
    handle.remove()


def test_host_keeping_parks_in_the_offload_pool_and_gives_it_back(config):
    model = _model(config)
    reference = _loss_and_grads(model, batch=2)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=1, moe_chunking=False, keep_sparse="host"))
    handle.offloader.min_bytes = 0  # park everything, however small (tiny's tensors are)
    ids = torch.randint(0, 5, (2, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    model.zero_grad(set_to_none=True)
    loss = chunked_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, targets != N_ID, 64)
    parked = handle.pinned_bytes()
    layer_input = 2 * T * config.mhc.num_streams * config.hidden * 4  # layer 0's offloaded input, fp32
    assert handle.keep.stats.bytes_kept > 0 and parked == layer_input + handle.keep.stats.bytes_kept
    assert handle.stats.packed == 1  # the layer-input statistics count the layer input only
    loss.backward()
    del loss
    gc.collect()
    assert handle.pinned_bytes() == 0  # every parked buffer back in the pool after backward
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == reference[1].keys()
    for name in reference[1]:
        assert _rel(grads[name], reference[1][name]) < 1e-4, name
    handle.remove()


def test_an_implementation_without_a_replay_is_recomputed(config, monkeypatch):
    model = _model(config)
    n_dsa = _n_dsa(config)
    runs = []
    reference = ops.implementations("dsa_sparse_attention")[ops.REFERENCE]

    def no_replay(*args, **kwargs):
        runs.append(torch.is_grad_enabled())
        return reference(*args, **kwargs)

    monkeypatch.setitem(ops._IMPLS, "dsa_sparse_attention", {ops.REFERENCE: reference, "no_replay": no_replay})
    with ops.policy("auto") as chosen:
        handle = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunking=False))
        _loss_and_grads(model)
    assert runs == [True] * (2 * n_dsa)  # forward and recompute, both with autograd
    assert handle.keep.stats.rerun == n_dsa and handle.keep.stats.replayed == n_dsa  # (the selection is kept)
    assert set(chosen.audit_summary()["dsa_sparse_attention"]) == {"no_replay"}
    handle.remove()


def test_kept_results_with_the_indexer_loss(config):
    model = _model(config)
    dsa = [layer.self_attn for layer in model.model.layers if layer.kind == "dsa"]
    results = {}
    for keep in ("off", "device"):
        for attn in dsa:
            attn.indexer_loss = IndexerLossSwitch("sparse", 1.0)
        handle = apply_memory_optimizations(model, MemoryOptions(offload=False, moe_chunking=False, keep_sparse=keep))
        results[keep] = _loss_and_grads(model)[1]
        handle.remove()
    indexer = [n for n in results["off"] if ".indexer." in n]
    assert indexer  # the indexer trained in both
    for name, g in results["off"].items():
        assert _rel(results["device"][name], g) < 1e-5, name


def test_the_reference_backward_from_out_and_lse_is_the_autograd_gradient():
    g = torch.Generator().manual_seed(3)
    batch, seq, kv_len, heads, dim, width = 2, 21, 40, 3, 16, 9
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(batch, kv_len, dim, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, kv_len, (batch, seq, width), generator=g, dtype=torch.int32)
    idx[0, 5] = -1  # a query with no keys
    idx[1, 3, :3] = 7  # the same key three times
    dout = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    out, lse = sparse_attention_reference(q, kv, idx, scale=0.3, return_lse=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    got_dq, got_dkv = sparse_attention_backward_reference(q.detach(), kv.detach(), idx, out.detach(), lse, dout, scale=0.3)
    torch.testing.assert_close(got_dq, dq, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got_dkv, dkv, atol=1e-12, rtol=1e-10)
    assert got_dq[0, 5].abs().max() == 0  # nothing for the empty row
    # The replay returns the kept tensors' values, with that gradient.
    replayed = sparse_attention_replay_reference((out.detach(), lse), q, kv, idx, scale=0.3)
    assert torch.equal(replayed, out.detach())
    rq, rkv = torch.autograd.grad(replayed, (q, kv), dout)
    torch.testing.assert_close(rq, dq, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(rkv, dkv, atol=1e-12, rtol=1e-10)


def test_a_recompute_that_calls_other_ops_is_refused():
    keep = KeptResults("device")
    frame = ReplayFrame(keep)
    a, b = torch.zeros(4, 3), torch.zeros(5, 3)
    frame.record("dsa_indexer_topk", 3, ops.REFERENCE, (a,), (a,))
    frame.replaying = True
    with pytest.raises(GenolongError, match="layer 3: its recompute called 'dsa_indexer_topk' where its forward called .*other input shapes"):
        frame.replay("dsa_indexer_topk", 3, (b,))
    frame.cursor = 1
    with pytest.raises(GenolongError, match="calls 'dsa_indexer_topk' more often than its forward did"):
        frame.replay("dsa_indexer_topk", 3, (a,))
    frame.cursor = 0
    impl, kept = frame.replay("dsa_indexer_topk", 3, (a,))
    assert impl == ops.REFERENCE and len(kept) == 1 and kept[0].data_ptr() == a.data_ptr()  # kept, not copied


def test_bad_keep_options_are_one_line():
    with pytest.raises(GenolongError, match="--keep-sparse must be one of auto, host, device, off"):
        MemoryOptions(keep_sparse="gpu").validate()
    with pytest.raises(GenolongError, match="--keep-sparse host parks results in the offload's pinned host pool"):
        MemoryOptions(offload=False, keep_sparse="host").validate()
    with pytest.raises(GenolongError, match="needs a HostOffloader"):
        KeptResults("host")
    assert MemoryOptions(recompute=False, offload=False).kept_where() is None  # nothing is recomputed
    assert MemoryOptions().kept_where() == "host" and MemoryOptions(offload=False).kept_where() == "device"
    assert MemoryOptions.baseline().kept_where() is None


def test_selections_are_kept_as_pools_and_come_back_exactly(monkeypatch):
    from genolong.model import kept_selection
    from genolong.model.indexer import indexer_topk_reference
    from genolong.model.kept_selection import pack_selection, unpack_selection

    monkeypatch.setattr(kept_selection, "_CHECK_ROWS", 16)  # the check in several chunks (the odd row is in the 7th)

    g = torch.Generator().manual_seed(2)
    iq, keys, w = torch.randn(2, 70, 2, 8, generator=g), torch.randn(2, 17, 8, generator=g), torch.rand(2, 70, 2, generator=g)
    idx = indexer_topk_reference(iq, keys, w, kpool=4, topk_pools=6, always_select_tail=True, softmax_scale=0.3)
    assert (idx[:, :10] == -1).any()  # early queries: fewer visible pools than selected ones
    packed = pack_selection(idx, kpool=4, topk_pools=6)
    assert [tuple(p.shape) for p in packed] == [(2, 70, 6), (2, 70, 3)]  # 9 int32 a token instead of 27
    assert torch.equal(unpack_selection(packed, kpool=4), idx)
    # A row in another order inside a pool is kept whole (and still comes back exactly).
    shuffled = idx.clone()
    shuffled[1, 50, :2] = shuffled[1, 50, :2].flip(0)
    whole = pack_selection(shuffled, kpool=4, topk_pools=6)
    assert len(whole) == 1 and torch.equal(unpack_selection(whole, kpool=4), shuffled)


def test_a_host_budget_too_small_for_the_kept_results_is_one_line(config):
    model = _model(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=0, moe_chunking=False, keep_sparse="host", host_budget_gib=1e-6))
    handle.offloader.min_bytes = 0
    with pytest.raises(GenolongError, match=r"more than the 0.0 GiB host budget; .*--keep-sparse device / off") as err:
        _loss_and_grads(model)
    assert "\n" not in str(err.value)
    handle.remove()


@pytest.mark.parametrize("keep", ["device", "host"])
def test_a_retained_graph_recomputes_and_replays_again(config, keep):
    model = _model(config)
    handle = apply_memory_optimizations(model, MemoryOptions(offload_layers=0, moe_chunking=False, keep_sparse=keep))
    ids = torch.randint(0, 5, (1, T + 1), generator=torch.Generator().manual_seed(1))
    loss = chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, ids[:, 1:], ids[:, 1:] != N_ID, 64)
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loss.backward()  # the checkpoint recomputes every layer a second time, from the same kept results
    for name, g in once.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, 2 * g, rtol=1e-5, atol=1e-8, msg=name)
    assert handle.keep.stats.replayed == 2 * handle.keep.stats.recorded
    handle.remove()


def test_the_replayed_attention_refuses_a_double_backward():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 6, (1, 6, 3), generator=g, dtype=torch.int32)
    with torch.no_grad():
        kept = sparse_attention_reference(q, kv, idx, scale=0.5, return_lse=True)
    out = sparse_attention_replay_reference(kept, q, kv, idx, scale=0.5)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    # The kept out and lse are constants of this node: a second derivative would be silently wrong.
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_plans_with_kept_results_on_the_cpu_and_the_fix_when_they_do_not_fit():
    from genolong.train.plan import estimate_cpu_memory, estimate_memory
    from genolong.train.preflight import shortfall

    tiny = get_preset("tiny")
    host = estimate_cpu_memory(tiny, 4096, MemoryOptions(keep_sparse="host"), ram_bytes=8 << 30)  # one RAM: kept in it
    device = estimate_cpu_memory(tiny, 4096, MemoryOptions(keep_sparse="device"), ram_bytes=8 << 30)
    assert host.gpu_total == device.gpu_total and "kept DSA results (device)" in host.gpu
    mini = get_preset("glm53-mini")
    opts = MemoryOptions(offload=False, keep_sparse="device", gpu_budget_gib=None)
    # 128k without offload: ~51.7 GiB planned, + 8.3 GiB of kept results; a 61 GiB GPU's budget is 56 GiB.
    kept = estimate_memory(mini, 131072, opts, gpu_bytes=61 << 30)
    off = estimate_memory(mini, 131072, MemoryOptions(offload=False, keep_sparse="off"), gpu_bytes=61 << 30)
    assert not kept.fits and off.fits
    assert "the DSA results recomputed, not kept: --keep-sparse off" in shortfall(mini, 131072, opts, 1, 61 << 30)


def test_a_deferred_selection_pack_resolves_to_what_the_synchronous_check_keeps():
    from genolong.model.indexer import indexer_topk_reference
    from genolong.model.kept_selection import PendingPack, pack_selection, pack_selection_deferred, unpack_selection

    g = torch.Generator().manual_seed(5)
    iq, keys, w = torch.randn(1, 40, 2, 8, generator=g), torch.randn(1, 10, 8, generator=g), torch.rand(1, 40, 2, generator=g)
    idx = indexer_topk_reference(iq, keys, w, kpool=4, topk_pools=5, always_select_tail=True, softmax_scale=0.3)
    shuffled = idx.clone()
    shuffled[0, 30, :2] = shuffled[0, 30, :2].flip(0)
    for sel in (idx, shuffled):
        pending = pack_selection_deferred(sel, kpool=4, topk_pools=5)
        assert isinstance(pending, PendingPack)
        assert unpack_selection(pending, kpool=4) is sel  # the forward goes on with the selection itself
        kept = pending.resolve()
        want = pack_selection(sel, kpool=4, topk_pools=5)
        assert len(want) == (2 if sel is idx else 1)  # the indexer's rows pack, the shuffled one does not
        assert len(kept) == len(want) and all(torch.equal(a, b) for a, b in zip(kept, want))
        assert torch.equal(unpack_selection(kept, kpool=4), sel)
        with pytest.raises(RuntimeError, match="resolves once"):
            pending.resolve()
    narrow = idx[..., :12]  # fewer slots than the pools' groups: nothing to pack, kept as it is
    assert pack_selection_deferred(narrow, kpool=4, topk_pools=5)[0] is narrow


class _Deferred(frames.DeferredKept):
    def __init__(self, t):
        self.t, self.resolved = t, 0

    def resolve(self):
        self.resolved += 1
        return (self.t,)


def test_a_deferred_kept_result_is_stored_at_the_next_record_or_when_the_forward_ends():
    from genolong.train.keep import _recording

    keep = KeptResults(where="device")
    frame = ReplayFrame(keep)
    a, b = _Deferred(torch.ones(3)), _Deferred(torch.zeros(2))
    with _recording(frame):
        frame.record("dsa_indexer_topk", 0, "x", (torch.ones(1),), a)
        assert a.resolved == 0 and keep.stats.bytes_kept == 0  # not chosen yet
        frame.record("dsa_sparse_attention", 0, "x", (torch.ones(1),), (torch.ones(4),))
        assert a.resolved == 1 and keep.stats.bytes_kept == 4 * 3 + 4 * 4  # chosen when the next op records
        frame.record("dsa_indexer_topk", 0, "x", (torch.ones(1),), b)
    assert b.resolved == 1  # the forward's end chooses what is still open
    assert [len(e.handles) for e in frame.entries] == [1, 1, 1] and all(e.pending is None for e in frame.entries)
    frame.replaying = True
    impl, kept = frame.replay("dsa_indexer_topk", 0, (torch.ones(1),))
    assert impl == "x" and torch.equal(kept[0], torch.ones(3))


def test_the_packing_check_is_deferred(monkeypatch):
    from genolong.model.kept_selection import PendingPack, pack_selection_deferred

    idx = torch.arange(24, dtype=torch.int32).view(1, 2, 12)  # two rows of three whole pools of 4
    kept = pack_selection_deferred(idx, kpool=4, topk_pools=3)
    assert isinstance(kept, PendingPack)
    assert torch.equal(kept.resolve()[0], torch.tensor([[[0, 1, 2], [3, 4, 5]]], dtype=torch.int32))
