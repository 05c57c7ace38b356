"""Sequence tiling: every decoder layer runs the sequence in tiles of `tile_tokens` tokens.

Under full-layer recompute a layer keeps only its input [B, S, 4, hidden], but while its backward
recomputes it, the layer's whole *working set* exists for the whole sequence at once (KDA's q/k/v
and gates, DSA's 64-head queries and attended latents, the MoE's expert activations, mHC's
mixing): 97.5 GiB for glm53-mini at 1M tokens by the plan, the largest item of the GPU budget.
Almost none of it needs the whole sequence: mHC, norms, MLP and MoE are per token; KDA is a
recurrence whose state (and the short conv's last kernel-1 inputs) can be carried from tile to
tile, the same affine state passing context parallelism does across ranks
(genolong/parallel/context_kda.py); DSA scores and attends each query independently against
the pooled indexer keys and the kv latent, which are small (1M x 512 latent: 1 GiB in bf16).

**Design.** `Tiled(DecoderLayer)` replaces `Recompute(DecoderLayer)` (print(model) shows
`Offload(Tiled(DecoderLayer))`); it is the recompute itself, at tile granularity:

- A KDA layer is a chain of tile functions, each under its own non-reentrant checkpoint:
  tile i maps (its slice of the layer input; the conv tail and recurrent state carried out of
  tile i-1) to (its slice of the layer output; the carried conv tail and state). The carried
  tensors reach the next tile by closure, so autograd sends their gradient back to tile i-1:
  the state gradient is carried backwards through the chain without any code of ours.
- A DSA layer runs two chains. The keys chain computes, per tile, the mixer input and from it
  the kv latent and (without gradient: the frozen selection) the indexer's pooled keys; they are
  concatenated into the whole sequence's. The query chain runs the plain layer on each tile,
  its DSA mixer given a genolong/model/piece.py `SequencePiece` whose `gather` hands back the
  whole latent / pooled keys: exactly what context parallelism gives a rank's queries, so the
  layer's own code (indexer with query_offset, sparse attention, indexer loss) runs unchanged.
  The latent's gradient from every query tile accumulates on the concatenation and flows back
  through the keys chain once all query tiles are done (autograd orders that).
- The indexer loss trains the indexer from the whole sequence's pooled keys as well; in a query
  tile's backward the pooled keys' gradient is parked (`_PoolKeyGrads`), and each keys-chain tile's
  backward, which autograd runs after every query tile's, turns its rows into the indexer
  parameters' gradient from its own (detached) mixer input.
- The expert balancer's sequence-wise balance loss needs each sequence's whole routing counts:
  the tile in force is published (`current_tile()`), the balancer accumulates counts per sequence
  over the layer's tiles and applies them in backward (genolong/train/balance.py).
- MoE chunking is off under tiling (a tile's MoE runs whole: the tile bounds it), and so is
  `--keep-moe` (it keeps a chunked MoE's output). The recall probe averages over every tile's
  sampled queries; the dense indexer warm-up (whole sequences, under no_grad) is refused.

Why one checkpoint per tile and no layer checkpoint around them: inside a recomputed layer, a
plain tile loop would save every tile's intermediates during the recompute (the whole working set
again), and a checkpoint per tile *inside* the layer checkpoint would run every tile's forward
three times a step. With only the tile checkpoints, each runs twice (forward, recompute in
backward), as under full recompute, and what the layer keeps between forward and backward is
its input (as the tiles' input slices: the `Offload` hooks move them to host memory tile by tile)
plus the small carried tensors and whole-sequence keys. During backward one tile's working set is
alive at a time. The cost: a DSA layer's mHC collapse and norm run once more per tile (the keys
chain), and both its chains save its input slices (the `Offload` hooks copy each to the host once).

Numerics: every step is the untiled layer's math on a subset of tokens (the short conv reads the
carried inputs where the untiled one reads the same previous tokens), except that the KDA
recurrence's chunks (16 tokens in the reference, 64 in fla) restart at each tile: the state at a
chunk boundary is the same quantity either way, so tiled equals untiled up to rounding.
tests/train/test_tiling.py checks loss and every gradient in fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from genolong.errors import GenolongError
from genolong.model import ops
from genolong.model.config import LAYER_KDA
from genolong.model.indexer_loss import DENSE
from genolong.model.piece import SequencePiece
from genolong.train.recompute import Recompute, checkpointed, decoder_body
from genolong.train.wrapper import wrap


@dataclass(eq=False)
class LayerCall:
    """One tiled forward of one layer: what its tiles share (the balance counts per MoE layer)."""

    batch: int
    seq_len: int
    counts: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class TileScope:
    call: LayerCall
    start: int
    stop: int


_ACTIVE: list[TileScope] = []


def current_tile() -> TileScope | None:
    """The tile whose function runs now (forward or its recompute in backward), or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def _in_tile(scope: TileScope):
    # A plain list, not a context variable: the recompute runs on autograd's thread on CUDA.
    _ACTIVE.append(scope)
    try:
        yield
    finally:
        _ACTIVE.pop()


class _PoolKeyGrads:
    """The indexer loss's gradient for the whole sequence's pooled keys, summed over query tiles."""

    def __init__(self, whole: torch.Tensor | None) -> None:
        self.whole = whole
        self.grad: torch.Tensor | None = None

    def add(self, grad: torch.Tensor) -> None:
        grad = grad.float()
        self.grad = grad if self.grad is None else self.grad + grad


class _ParkPoolKeyGrad(torch.autograd.Function):
    """A query tile's view of the whole pooled keys for the indexer loss: forward the whole keys
    (a copy: the tile's own pools are the same values), backward parks their gradient and gives
    the tile's own pooled keys none (their rows come back through the keys chain)."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, parked: _PoolKeyGrads) -> torch.Tensor:
        ctx.parked = parked
        return parked.whole.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.parked.add(grad)
        return None, None


class _PoolKeyGradient(torch.autograd.Function):
    """Identity on a keys-chain tile's latent whose backward also turns the parked pooled-key
    gradient of this tile's pools into the indexer parameters' gradient (from the tile's mixer
    input, detached: the indexer loss trains the indexer only, as untiled)."""

    @staticmethod
    def forward(ctx, latent, x, spec, *params):
        ctx.save_for_backward(x)
        ctx.spec = (*spec, ops.active())
        return latent.view_as(latent)

    @staticmethod
    def backward(ctx, grad_latent):
        (x,) = ctx.saved_tensors
        indexer, parked, first_pool, policy = ctx.spec
        params = list(indexer.parameters())
        n_pools = x.shape[1] // indexer.cfg.kpool
        if parked.grad is None or n_pools == 0:
            return (grad_latent, None, None, *([None] * len(params)))
        rows = parked.grad[:, first_pool : first_pool + n_pools]
        with ops.policy(policy), torch.enable_grad():
            keys = indexer.pool_keys(x)
            grads = torch.autograd.grad(keys, params, rows.to(keys.dtype), allow_unused=True)
        return (grad_latent, None, None, *grads)


def _tile_piece(start: int, stop: int, length: int, latent: torch.Tensor, pool_keys: torch.Tensor | None,
                parked: _PoolKeyGrads) -> SequencePiece:
    """A query tile's SequencePiece: `gather` returns the whole sequence's latent or pooled keys for
    the tile's own (told apart by width, else by rows: tile tokens vs tile pools; `check_tileable`
    rules out the one shape where neither differs)."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        is_latent = pool_keys is None or t.shape[-1] != pool_keys.shape[-1] or (
            t.shape[-1] == latent.shape[-1] and t.shape[1] == stop - start and pool_keys.shape[1] != latent.shape[1])
        if is_latent:
            return latent
        if torch.is_grad_enabled() and t.requires_grad:
            return _ParkPoolKeyGrad.apply(t, parked)
        return pool_keys

    return SequencePiece(offset=start, length=length, gather=gather, total=lambda t: t)


class Tiled(Recompute):
    """The wrapped decoder layer run in tiles of `tile_tokens` tokens, each tile checkpointed when
    autograd records and `checkpoint` is on (module docstring). A sequence of one tile runs as
    `Recompute` (checkpointed whole) or plain."""

    def __init__(self, module: torch.nn.Module, tile_tokens: int, kpool: int, *, checkpoint: bool = True,
                 preserve_rng_state: bool = True, keep=None) -> None:
        super().__init__(module, preserve_rng_state, keep)
        self.tile_tokens = tile_tokens
        self.kpool = kpool  # the indexer's pool: tiles start at whole pools
        self.checkpoint_tiles = checkpoint
        self.tiles_run = 0  # tile functions run (forward and recompute); tests read it

    def forward(self, streams: torch.Tensor, *args, **kwargs):
        seq = streams.shape[1]
        if seq <= self.tile_tokens:
            if self.checkpoint_tiles:
                return super().forward(streams, *args, **kwargs)
            return self.wrapped(streams, *args, **kwargs)
        layer = self.wrapped
        # split, not a slice per tile: one backward node assembles the input's gradient from the
        # tiles' once, where slices would each add a whole-sequence zero-padded copy.
        parts = streams.split(self.tile_tokens, dim=1)
        starts = [i * self.tile_tokens for i in range(len(parts))]
        bounds = [(a, a + p.shape[1], p) for a, p in zip(starts, parts)]
        call = LayerCall(batch=streams.shape[0], seq_len=seq)
        if layer.kind == LAYER_KDA:
            return self._kda(layer, bounds, call)
        topk = args[0] if args else kwargs.get("topk")
        return self._dsa(layer, bounds, call, None if topk is None else topk.split(self.tile_tokens, dim=1), seq)

    def _run(self, fn, *args):
        if self.checkpoint_tiles and torch.is_grad_enabled():
            self.calls += 1
            return checkpointed(fn, *args, preserve_rng_state=self.preserve_rng_state, keep=self.keep)
        return fn(*args)

    def _kda(self, layer, bounds, call):
        attn = layer.self_attn
        outs, tail, state = [], None, None
        for a, b, part in bounds:

            def tile(part, tail=tail, state=state, scope=TileScope(call, a, b)):
                self.tiles_run += 1
                carried = {}

                def mixer(x):
                    out, carried["tail"], carried["state"] = kda_tile(attn, x, tail, state)
                    return out

                with _in_tile(scope):
                    out = layer.mlp_half(layer.attention_half(part, mixer))
                return out, carried["tail"], carried["state"]

            out, tail, state = self._run(tile, part)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def _dsa(self, layer, bounds, call, topks, seq):
        attn = layer.self_attn
        indexer = attn.indexer
        switch = attn.indexer_loss if indexer is not None else None
        if switch is not None and switch.mode == DENSE:
            raise GenolongError("the dense indexer warm-up runs on whole sequences: train it with --tile off (or the sparse indexer loss)")
        kpool = self.kpool
        trains_indexer = switch is not None and torch.is_grad_enabled()
        parked = _PoolKeyGrads(None)
        latents, pools = [], []
        for a, b, part in bounds:

            def keys(part, first_pool=a // kpool):
                self.tiles_run += 1
                x = layer.mixer_input(part)
                latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x))
                if trains_indexer:
                    latent = _PoolKeyGradient.apply(latent, x.detach(), (indexer, parked, first_pool), *indexer.parameters())
                if indexer is None:
                    return latent
                with torch.no_grad():
                    return latent, indexer.pool_keys(x)

            got = self._run(keys, part)
            latents.append(got if indexer is None else got[0])
            if indexer is not None:
                pools.append(got[1])
        latent = torch.cat(latents, dim=1)
        pool_keys = torch.cat(pools, dim=1) if indexer is not None else None
        parked.whole = pool_keys

        outs, chosen = [], []
        for i, (a, b, part) in enumerate(bounds):
            piece = _tile_piece(a, b, seq, latent, pool_keys, parked)

            def tile(part, *given, piece=piece, scope=TileScope(call, a, b)):
                self.tiles_run += 1
                found = []

                def mixer(x):
                    out, selected = attn(x, given[0] if given else None, piece=piece)
                    found.append(selected)
                    return out

                with _in_tile(scope):
                    out = layer.mlp_half(layer.attention_half(part, mixer))
                return (out, found[0]) if layer.emits_topk else out

            given = (topks[i],) if layer.reuses_topk else ()
            got = self._run(tile, part, *given)
            if layer.emits_topk:
                got, selected = got
                chosen.append(selected)
            outs.append(got)
        out = torch.cat(outs, dim=1)
        return (out, torch.cat(chosen, dim=1)) if layer.emits_topk else out

    def extra_repr(self) -> str:
        how = "each tile checkpointed" if self.checkpoint_tiles else "not checkpointed"
        rest = super().extra_repr()
        return f"tile_tokens={self.tile_tokens}, {how}" + (f", {rest}" if rest else "")


def kda_tile(attn, x: torch.Tensor, tail: torch.Tensor | None, state: torch.Tensor | None):
    """The KDA mixer on a tile x [B, T, hidden] that follows the tokens whose last kernel-1 pre-conv
    inputs are `tail` and whose recurrent state is `state` (None, None: the sequence's start) ->
    (output [B, T, hidden], this tile's tail, the state after it)."""
    qkv = attn.qkv_projections(x)
    weight = attn.conv1d.weight.squeeze(1)
    halo = weight.shape[-1] - 1
    if tail is None:
        conv = ops.call("kda_short_conv", attn.layer_idx, qkv, weight)
    else:
        conv = ops.call("kda_short_conv", attn.layer_idx, torch.cat([tail, qkv], dim=1), weight)[:, halo:]
    # A copy: a view would keep the tile's whole qkv alive for as long as the next tile needs the tail.
    new_tail = qkv[:, qkv.shape[1] - halo :].clone() if halo else qkv[:, :0]
    q, k, v, g, beta = attn.recurrence_inputs(x, conv)
    o, new_state = ops.call("kda", attn.layer_idx, q, k, v, g, beta, initial_state=state, output_final_state=True)
    return attn.output(x, o), new_tail, new_state


def check_tileable(config, tile_tokens: int) -> None:
    """Raise a one-line GenolongError if `config` (a ModelConfig) cannot run in tiles of `tile_tokens`."""
    kpool = config.dsa.indexer.kpool
    halo = config.kda.conv_kernel - 1
    if tile_tokens < max(halo, 1) or tile_tokens % kpool:
        raise GenolongError(
            f"--tile {tile_tokens}: a tile must be a whole number of the indexer's {kpool}-token pools and at least "
            f"the short conv's {halo} tokens; use a multiple of {max(kpool, 64)} (e.g. 128k)"
        )
    if kpool == 1 and config.dsa.kv_lora_rank == config.dsa.indexer.head_dim:
        raise GenolongError("--tile needs the indexer's kpool > 1 or kv_lora_rank != the indexer's head_dim; use --tile off")


def apply_tiling(model: torch.nn.Module, tile_tokens: int, *, checkpoint: bool = True) -> list[Tiled]:
    """Wrap every decoder layer of `model` in Tiled; returns the wrappers (the memory pass's `recompute` list)."""
    body = decoder_body(model)
    check_tileable(body.config, tile_tokens)
    from genolong.model.dsa import DSAAttention
    from genolong.model.kda import KimiDeltaAttention

    for layer in body.layers:
        mixer = layer.self_attn
        if type(mixer) not in (DSAAttention, KimiDeltaAttention):
            raise GenolongError(f"--tile runs the plain single-device mixers; layer {layer.layer_idx} has {type(mixer).__name__} "
                                "(a parallel pass switched it): use --tile off with --parallel")
    kpool = body.config.dsa.indexer.kpool
    return [wrap(body.layers, str(i), Tiled, tile_tokens, kpool, checkpoint=checkpoint) for i in range(len(body.layers))]
