"""Sequence tiling (genolong.train.tiling) on the CPU `tiny` model in fp32 with the reference ops:
tiled equals untiled (loss, the indexer loss and the balance loss, every parameter gradient) at
several tile lengths including an uneven last tile, with and without the tile checkpoints, with
offload and kept DSA results; and no whole-sequence working tensor exists inside a tiled layer."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genolong.errors import GenolongError
from genolong.model import GenoLongForCausalLM, get_preset
from genolong.model.indexer_loss import SPARSE, IndexerLossSwitch
from genolong.train.balance import ExpertBalancer
from genolong.train.loss import chunked_lm_loss
from genolong.train.memory import apply_memory_optimizations
from genolong.train.options import MemoryOptions, parse_tile
from genolong.train.tiling import Tiled, apply_tiling
from genolong.vocab import N_ID

T = 150  # not a multiple of any tile below: the last tile is shorter
BATCH = 2


def _config(shared: bool = False):
    # Selections (16 keys) much smaller than the context, so the sparse path and the indexer matter;
    # three KDA heads so that q/k/v (96 wide) differ from the hidden width (64) in the memory test.
    layers = 8 if shared else 4
    kinds = {"indexer_types": ("full",) * 7 + ("shared",)} if shared else {}
    return get_preset("tiny", num_layers=layers, dsa={"indexer": {"topk": 16}}, kda={"num_heads": 3}, **kinds)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return GenoLongForCausalLM(_config())


def _step(model, *, indexer_loss=True, aux=0.01, **switch):
    """One forward + backward of the LM loss with the indexer loss (its switch's options `switch`)
    and the balance loss on -> (loss, balance loss, {layer: indexer loss}, {name: grad})."""
    switches = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "DSAAttention" and m.indexer is not None and indexer_loss:
            m.indexer_loss = switches[m.layer_idx] = IndexerLossSwitch(SPARSE, 0.5, **switch)
    balancer = ExpertBalancer(model, aux_loss_coeff=aux)
    balancer.begin_step(BATCH * T, T)
    ids = torch.randint(0, 5, (BATCH, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss = chunked_lm_loss(model.hidden_states(inputs), model.lm_head.weight, targets, targets != N_ID, 64)
    loss.backward()
    stats = balancer.finish_step(update_bias=False)
    balancer.remove()
    kl = {i: float(sum(s.values.values())) for i, s in switches.items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), stats.aux_loss, kl, grads


def _assert_same(ref, got, rel=2e-4):
    loss0, aux0, kl0, g0 = ref
    loss1, aux1, kl1, g1 = got
    assert loss1 == pytest.approx(loss0, rel=1e-6, abs=1e-6)
    assert aux1 == pytest.approx(aux0, rel=1e-5)
    assert kl0 and kl1.keys() == kl0.keys()
    for i in kl0:
        assert kl1[i] == pytest.approx(kl0[i], rel=1e-3)  # a KL near 0: a difference of near-equal terms
    assert g1.keys() == g0.keys()
    for name, g in g0.items():
        scale = g.abs().max().item()
        assert scale > 0 or name.endswith("e_score_correction_bias"), name
        err = (g1[name] - g).abs().max().item()
        assert err <= rel * scale + 1e-7, f"{name}: {err:.3g} apart at scale {scale:.3g}"


@pytest.fixture(scope="module")
def untiled(base):
    model = copy.deepcopy(base)
    apply_memory_optimizations(model, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False))
    return _step(model)


@pytest.mark.parametrize("tile", [32, 48, 100])
def test_tiled_equals_untiled_under_recompute(base, untiled, tile):
    model = copy.deepcopy(base)
    handle = apply_memory_optimizations(model, MemoryOptions(offload=False, keep_sparse="off", tile_tokens=tile))
    assert all(isinstance(w, Tiled) for w in handle.recompute)
    assert "Tiled(" in repr(model) and f"tile_tokens={tile}, each tile checkpointed" in repr(model)
    assert "ChunkedMoE" not in repr(model)
    assert handle.describe()["tile_tokens"] == tile and handle.describe()["moe_chunk_tokens"] is None
    _assert_same(untiled, _step(model))
    tiles = -(-T // tile)
    # per layer: each tile's function in the forward and again in backward; a DSA layer runs two chains
    dsa = len(_config().dsa_layers)
    assert sum(w.tiles_run for w in handle.recompute) == 2 * tiles * (len(handle.recompute) + dsa)


def test_tiles_score_the_query_blocks_the_whole_sequence_scores(base, untiled):
    # Blocks of 32 queries (the last of 22), half of them scored: tiles of 48 cut blocks in two, and
    # the tiles must score exactly the whole sequence's blocks, normalised by the whole's count.
    subset = dict(query_fraction=0.5, query_block=32, seed=3, step=11)
    plain = copy.deepcopy(base)
    apply_memory_optimizations(plain, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False))
    whole = _step(plain, **subset)
    assert all(abs(whole[2][i] / untiled[2][i] - 1) > 1e-3 for i in whole[2])  # a subset, not every query
    tiled = copy.deepcopy(base)
    apply_memory_optimizations(tiled, MemoryOptions(offload=False, keep_sparse="off", tile_tokens=48))
    _assert_same(whole, _step(tiled, **subset))


def test_tiled_equals_untiled_without_checkpoints(base, untiled):
    model = copy.deepcopy(base)
    wrappers = apply_tiling(model, 64, checkpoint=False)
    _assert_same(untiled, _step(model))
    assert sum(w.calls for w in wrappers) == 0


def test_shared_topk_layers_and_offload_with_kept_results():
    torch.manual_seed(3)
    base = GenoLongForCausalLM(_config(shared=True))
    assert base.config.reuses_topk(7)
    plain = copy.deepcopy(base)
    apply_memory_optimizations(plain, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False))
    tiled = copy.deepcopy(base)
    handle = apply_memory_optimizations(tiled, MemoryOptions(offload_layers=5, keep_sparse="device", tile_tokens=64))
    _assert_same(_step(plain), _step(tiled))
    stats = handle.offloader.stats
    # the offloaded layers' input slices went to the (pageable, on the CPU) host pool and came back:
    # two slices of 64 tokens a layer (the 22-token last one is under the offloader's minimum size),
    # the DSA layer 3's copied once though both its tile chains save them, and unpacked by both
    assert stats.layers == set(range(5)) and stats.packed == 2 * 5 and stats.unpacked == stats.packed + 2
    assert handle.pinned_bytes() == 0
    # the recompute of each query tile took its selection and attention from the tile's forward
    assert handle.keep.stats.replayed == handle.keep.stats.recorded > 0 and handle.keep.stats.rerun == 0


@pytest.mark.parametrize("offload_layers", [None, 2])
def test_fp8_layer_inputs_in_tiles(base, untiled, offload_layers):
    """fp8 storage (--layer-inputs fp8) of each tile's input slice: the loss is the exact run's (the
    forward reads the exact inputs), the gradients within fp8's reach of it (as untiled:
    tests/train/test_layer_inputs.py; not equal to the untiled fp8 run's, whose recompute carries KDA
    states and DSA keys rebuilt from fp8 where a tiled one carries the forward's). Tiles of 52 (the last
    of 46): every slice is above the offloader's minimum size."""
    where = dict(offload=False) if offload_layers is None else dict(offload_layers=offload_layers)
    model = copy.deepcopy(base)
    handle = apply_memory_optimizations(model, MemoryOptions(keep_sparse="off", tile_tokens=52, layer_inputs="fp8", **where))
    loss, aux, _, grads = _step(model)
    assert loss == pytest.approx(untiled[0], rel=1e-6) and aux == pytest.approx(untiled[1], rel=1e-5)
    exact = torch.cat([g.flatten() for g in untiled[3].values()])
    got = torch.cat([grads[n].flatten() for n in untiled[3]])
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.1, rel
    assert torch.nn.functional.cosine_similarity(got, exact, dim=0).item() > 0.99
    stats = handle.offloader.stats
    # three slices a layer, a DSA layer's two chains' saves of one slice stored once
    assert stats.quantized == 3 * len(handle.recompute) and stats.packed == 3 * (offload_layers or 0)
    assert handle.pinned_bytes() == 0 and handle.offloader.live_entries() == 0


def test_a_sequence_of_one_tile_runs_the_whole_layer(base):
    model = copy.deepcopy(base)
    plain = copy.deepcopy(base)
    apply_memory_optimizations(plain, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False))
    handle = apply_memory_optimizations(model, MemoryOptions(offload=False, keep_sparse="off", tile_tokens=256))
    _assert_same(_step(plain), _step(model), rel=1e-6)
    assert sum(w.tiles_run for w in handle.recompute) == 0 and sum(w.calls for w in handle.recompute) == len(handle.recompute)


class _WideTensors(TorchDispatchMode):
    """Every op output that holds a whole sequence of tokens (S along dim 1, or B*S rows of a 2-D
    tensor) with a per-token width outside `allowed` (per-token statistics, width <= 2, pass)."""

    def __init__(self, batch: int, seq: int, allowed: set[int]) -> None:
        super().__init__()
        self.batch, self.seq, self.allowed = batch, seq, allowed
        self.found: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                whole = (t.dim() >= 3 and t.shape[0] == self.batch and t.shape[1] == self.seq) or (
                    t.dim() == 2 and t.shape[0] == self.batch * self.seq)
                width = t.numel() // (self.batch * self.seq)
                if whole and width > 2 and width not in self.allowed:
                    self.found.add((str(func), tuple(t.shape)))
        return out


def test_no_whole_sequence_working_tensor_inside_a_tiled_layer(base):
    config = base.config
    h = config.hidden
    # the layer inputs / outputs and their gradients (4 streams), the embedding and the final
    # hidden states (hidden), the whole DSA latent (kv_lora_rank), the shared top-k (its width)
    allowed = {config.mhc.num_streams * h, h, config.dsa.kv_lora_rank, config.dsa.indexer.width}
    found = {}
    for tile in (None, 64):
        model = copy.deepcopy(base)
        apply_memory_optimizations(model, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False, tile_tokens=tile))
        with _WideTensors(BATCH, T, allowed) as mode:
            _step(model, indexer_loss=True)
        found[tile] = mode.found
    assert found[None], "the untiled layer's whole-sequence intermediates should show"
    assert not found[64], sorted(found[64])[:5]


def test_tile_flags_and_refusals():
    assert parse_tile("128k") == (131072, False)
    assert parse_tile("auto") == (None, True)
    assert parse_tile("off") == (None, False)
    with pytest.raises(GenolongError, match="--tile"):
        MemoryOptions(tile_tokens=64, recompute=False, offload=False).validate()
    with pytest.raises(GenolongError, match="--keep-moe"):
        MemoryOptions(tile_tokens=64, keep_moe=True).validate()
    model = GenoLongForCausalLM(get_preset("tiny"))
    with pytest.raises(GenolongError, match="whole number of the indexer's 4-token pools"):
        apply_tiling(model, 66)
    opts = MemoryOptions(tile_tokens=128)
    assert opts.tiles_at(128) is None and opts.tiles_at(129) == 128
    apply_tiling(model, 64)
    model.model.layers[3].self_attn.indexer_loss = IndexerLossSwitch("dense", 1.0)
    with torch.no_grad(), pytest.raises(GenolongError, match="dense indexer warm-up runs on whole sequences"):
        model(torch.zeros(1, T, dtype=torch.long))


def test_the_plan_counts_one_tile_of_working_set_and_auto_picks_a_tile_that_fits():
    from genolong.train.plan import GIB, H200_BYTES, estimate_memory
    from genolong.train.preflight import preflight

    config = get_preset("glm53-mini")
    seq = 1 << 20

    def working(tile):
        est = estimate_memory(config, seq, MemoryOptions(tile_tokens=tile, keep_sparse="off"), 1, H200_BYTES)
        return next(v for k, v in est.gpu.items() if k.startswith("layer working set")), est

    whole, _ = working(None)
    half, _ = working(1 << 16)
    full, est = working(1 << 17)
    # the per-token items scale with the tile; the two whole-sequence stream gradients do not
    streams = 2 * 4 * config.hidden * 2 * seq
    assert whole > 3.5 * full  # (74.6 GiB whole, 18.9 with 128k tiles)
    assert (full - streams) / (half - streams) == pytest.approx(2, rel=0.1)
    assert est.gpu["dsa whole-sequence keys (tiling)"] == pytest.approx(len(config.dsa_layers) * seq * 2 * (512 + 128 / 4), rel=1e-6)
    opts = MemoryOptions(tile_auto=True)
    est = preflight(config, seq, opts, 1, H200_BYTES, host_bytes=128 * GIB)
    assert est.fits and opts.tile_tokens == est.opts.tile_tokens and opts.tile_tokens < seq
    assert opts.keep_sparse == "off"  # the kept DSA results (66 GiB pinned at 1M) do not fit beside the inputs
    with pytest.raises(GenolongError, match="does not fit|short"):
        preflight(config, seq, MemoryOptions(), 1, H200_BYTES, host_bytes=128 * GIB)


def test_the_recall_probe_measures_the_queries_of_every_tile(base):
    from genolong.model.indexer_recall import RecallProbe

    values = {}
    for tile in (None, 48):
        model = copy.deepcopy(base)
        apply_memory_optimizations(model, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False, tile_tokens=tile))
        probes = {}
        for m in model.modules():
            if type(m).__name__ == "DSAAttention" and m.indexer is not None:
                m.recall_probe = probes[m.layer_idx] = RecallProbe(64)
        _step(model, indexer_loss=False, aux=0.0)
        values[tile] = {i: p.values[i] for i, p in probes.items()}
    assert values[None] and values[48] == pytest.approx(values[None], rel=1e-5)


def test_the_copy_oracle_selects_the_same_under_tiles(base):
    """The copy curriculum's oracle covers the whole sequence; each query tile takes its own part of it,
    so a tiled step equals the untiled one with the oracle on (and differs from a step without it)."""
    import numpy as np

    from genolong.train.copy_oracle import oracle_keys, selection_oracle

    ids = torch.randint(0, 4, (BATCH, T + 1), generator=torch.Generator().manual_seed(1))
    ids[:, 110:150] = ids[:, 5:45]  # a copy ~105 back: far outside the 16-key selections
    keys = torch.from_numpy(oracle_keys(ids[:, :-1].numpy().astype(np.int64), 12))
    assert (keys[:, 121:150] >= 0).all()

    def step(model):
        with selection_oracle(model, keys):
            loss = chunked_lm_loss(model.hidden_states(ids[:, :-1]), model.lm_head.weight, ids[:, 1:], ids[:, 1:] != N_ID, 64)
            loss.backward()
        return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = copy.deepcopy(base)
    apply_memory_optimizations(plain, MemoryOptions(offload=False, keep_sparse="off", moe_chunking=False))
    tiled = copy.deepcopy(base)
    apply_memory_optimizations(tiled, MemoryOptions(offload=False, keep_sparse="off", tile_tokens=48))
    (loss0, g0), (loss1, g1) = step(plain), step(tiled)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for name, g in g0.items():
        assert (g1[name] - g).abs().max().item() <= 2e-4 * g.abs().max().item() + 1e-7, name
    without = copy.deepcopy(base)
    loss_without = chunked_lm_loss(without.hidden_states(ids[:, :-1]), without.lm_head.weight, ids[:, 1:], ids[:, 1:] != N_ID, 64)
    assert float(loss_without) != pytest.approx(loss0, rel=1e-6)
