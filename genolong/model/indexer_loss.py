"""The DSA indexer's KL loss: the indexer learns to predict where the main attention looks.

Per query t, over a set of complete pools (docs/model.md "Training the indexer"):
- target pi(t, p): the main attention's probability mass on the tokens of pool p, summed over
  heads, renormalised over the set (the query's incomplete tail pool is not in the set: the
  indexer never scores it, it is always selected; its attention mass is left out);
- prediction: softmax over the set of the indexer scores I(t, p) = sum_h w[t,h] relu(scale q[t,h].K[p]);
- loss: KL(pi || softmax(I)) = sum_p pi log pi - pi log softmax(I)_p; 0 for a query with no pool.

Two stages, as DeepSeek-V3.2:
- sparse (`SPARSE`): the set is the query's selected pools; the attention probabilities are
  rebuilt from the sparse attention's log-sum-exp, exp(scale q.kv - lse), so no [T x T] exists.
  This is the hot op "dsa_indexer_loss" (docs/ops.md); `indexer_loss_reference` is its oracle.
- dense warm-up (`DENSE`): the set is every complete pool the query can see, the target dense
  causal attention over all visible keys. O(T^2) work and meant for short contexts; chunked over
  queries so that only [chunk x T] scores exist.

The loss is terminal (nothing downstream of it), so the op returns its value *and* its gradient
with respect to the indexer's three projections in one pass: no second pass, nothing saved.
Gradients reach only the indexer's own parameters: its inputs are detached, and the target is a
constant. How the loss enters training: `IndexerLossSwitch` (set on a DSA layer from outside,
genolong/train/indexer.py) and `attach_indexer_loss` (the sparse stage's backward hook).

Query subset (`--indexer-loss-queries F`, docs/training.md "The indexer"): the sparse stage may
take its KL over a random subset of the sequence's query blocks only (`scored_blocks`), the mean
over the scored queries, so its gradient is an unbiased estimate of the full mean's (exactly when
the length is a multiple of the block) and the recorded value stays comparable; F = 1 scores every query, exactly as without the option.

Memory: the sparse stage keeps nothing of the indexer from the forward (the top-k runs under
no_grad as when frozen); the backward recomputes the indexer's projections from the layer's own
saved inputs, the queries in chunks, so its extra memory at 512k is the pooled keys' graph and
one chunk, not [T x ...] indexer activations.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from genolong.errors import GenolongError
from genolong.model import ops

SPARSE, DENSE = "sparse", "dense"

# Upper bound on the elements of the largest per-chunk tensor of the references (gathered latents,
# dense scores); fp32: 64 MiB.
_CHUNK_ELEMENTS = 1 << 24
# Attention mass below this (a query whose attention sits entirely on its tail pool) gives a zero
# target: no loss and no gradient for that query, rather than 0/0.
_TINY_MASS = 1e-30


def wide(dtype: torch.dtype) -> torch.dtype:
    """The references' compute dtype: fp32, or the input's if wider (float64 tests)."""
    return torch.promote_types(dtype, torch.float32)


def selected_pools(indices: torch.Tensor, kpool: int, topk_pools: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [..., W] -> (pool ids long [..., S], valid bool [..., S]) of the selected pool slots.

    Slots [s*kpool, (s+1)*kpool) hold the tokens of one complete pool (any order) or are all -1.
    Invalid entries of the pool ids are 0 (a safe gather index).
    """
    groups = indices[..., : topk_pools * kpool].long().unflatten(-1, (topk_pools, kpool))
    valid = groups[..., 0] >= 0
    return torch.where(valid, groups.amax(-1) // kpool, 0), valid


def normalise(mass: torch.Tensor) -> torch.Tensor:
    return mass / mass.sum(-1, keepdim=True).clamp_min(_TINY_MASS)


@torch.no_grad()
def sparse_target(q, kv, indices, lse, *, scale: float, kpool: int, topk_pools: int) -> torch.Tensor:
    """Attention mass per selected pool, summed over heads, not normalised: [B, t, S] (`wide`).

    q [B,t,H,Dl], kv [B,S_kv,Dl], indices [B,t,W], lse [B,t,H] natural log (fp32, -inf: no key).
    """
    batch, rows, _, latent = q.shape
    idx = indices[..., : topk_pools * kpool].long()
    valid = idx >= 0
    gathered = kv.gather(1, idx.clamp(min=0).reshape(batch, -1, 1).expand(-1, -1, latent))
    dtype = wide(q.dtype)
    gathered = gathered.view(batch, rows, idx.shape[-1], latent).to(dtype)
    scores = torch.matmul(q.to(dtype), gathered.transpose(-1, -2)) * scale  # [B, t, H, S*kpool]
    probs = torch.where(valid.unsqueeze(2), (scores - lse.to(dtype).unsqueeze(-1)).exp(), 0.0)
    return probs.sum(2).unflatten(-1, (topk_pools, kpool)).sum(-1)


def kl_and_grads(index_q, pool_keys, head_weights, pools, valid, target, *, index_scale: float, grad_scale: float):
    """KL(target || softmax(indexer scores)) per query and the gradient of grad_scale * its sum.

    index_q [B,t,Hi,Di], head_weights [B,t,Hi] (one query chunk), pool_keys [B,P,Di] (all pools),
    pools long [B,t,S] (None: pools 0..S-1 for every query), valid bool [B,t,S], target [B,t,S]
    summing to 1 (or 0) over the valid pools. Returns (kl [B,t], d_index_q, d_pool_keys [B,P,Di],
    d_head_weights), all in `wide(index_q.dtype)`.
    """
    dtype = wide(index_q.dtype)
    with torch.enable_grad():
        iq = index_q.detach().to(dtype).requires_grad_()
        pk = pool_keys.detach().to(dtype).requires_grad_()
        w = head_weights.detach().to(dtype).requires_grad_()
        if pools is None:
            scores = torch.einsum("bthd,bsd->bths", iq, pk[:, : valid.shape[-1]])
        else:
            keys = pk.gather(1, pools.reshape(pools.shape[0], -1, 1).expand(-1, -1, pk.shape[-1]))
            scores = torch.einsum("bthd,btsd->bths", iq, keys.view(*pools.shape, -1))
        logits = torch.einsum("bth,bths->bts", w, F.relu(scores * index_scale))
        # A finite floor, not -inf: a query with no valid pool must give zero gradient, not NaN.
        logp = logits.masked_fill(~valid, torch.finfo(logits.dtype).min).log_softmax(-1)
        target = target.to(dtype)
        kl = (torch.xlogy(target, target) - target * logp).sum(-1)
        grads = torch.autograd.grad(kl.sum() * grad_scale, (iq, pk, w))
    return (kl.detach(), *grads)


def indexer_loss_reference(
    index_q: torch.Tensor,
    pool_keys: torch.Tensor,
    head_weights: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    *,
    kpool: int,
    topk_pools: int,
    index_scale: float,
    scale: float,
    grad_scale: float,
):
    """The "dsa_indexer_loss" op (docs/ops.md): the sparse-stage KL per query and its gradient.

    -> (kl fp32 [B,T], d_index_q, d_pool_keys, d_head_weights), the gradients of
    grad_scale * kl.sum() in the dtypes of index_q, pool_keys, head_weights. Computed in fp32
    (in float64 for float64 inputs).
    """
    batch, seq, heads, latent = q.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * topk_pools * kpool * max(latent, heads)))
    dtype = wide(index_q.dtype)
    kl = torch.zeros(batch, seq, dtype=dtype, device=q.device)
    d_iq = torch.zeros(index_q.shape, dtype=dtype, device=q.device)
    d_pk = torch.zeros(pool_keys.shape, dtype=dtype, device=q.device)
    d_w = torch.zeros(head_weights.shape, dtype=dtype, device=q.device)
    for t0 in range(0, seq, step):
        t1 = min(seq, t0 + step)
        idx = indices[:, t0:t1]
        mass = sparse_target(q[:, t0:t1], kv, idx, lse[:, t0:t1], scale=scale, kpool=kpool, topk_pools=topk_pools)
        pools, valid = selected_pools(idx, kpool, topk_pools)
        kl[:, t0:t1], d_iq[:, t0:t1], pk, d_w[:, t0:t1] = kl_and_grads(
            index_q[:, t0:t1], pool_keys, head_weights[:, t0:t1], pools, valid, normalise(mass * valid),
            index_scale=index_scale, grad_scale=grad_scale,
        )
        d_pk += pk
    return kl, d_iq.to(index_q.dtype), d_pk.to(pool_keys.dtype), d_w.to(head_weights.dtype)


ops.register("dsa_indexer_loss", ops.REFERENCE, indexer_loss_reference)


@torch.no_grad()
def dense_target(q, kv, t0: int, *, scale: float, kpool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention of the queries at t0 + [0, t) over every visible key, summed over
    heads and over the tokens of each complete pool -> (target [B,t,P_vis] normalised over the
    pools the query can see, valid bool [B,t,P_vis])."""
    batch, rows = q.shape[:2]
    t1 = t0 + rows
    n_pools = t1 // kpool
    pos = torch.arange(t0, t1, device=q.device)
    dtype = wide(q.dtype)
    scores = torch.einsum("bthd,bjd->bthj", q.to(dtype), kv[:, :t1].to(dtype)) * scale
    visible = torch.arange(t1, device=q.device) <= pos[:, None]  # [t, t1]
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1).sum(2)  # [B, t, t1]
    mass = probs[..., : n_pools * kpool].unflatten(-1, (n_pools, kpool)).sum(-1)
    valid = ((torch.arange(n_pools, device=q.device) + 1) * kpool <= pos[:, None] + 1).expand(batch, -1, -1)
    return normalise(mass * valid), valid


def indexer_dense_loss(
    index_q, pool_keys, head_weights, q, kv, *, kpool: int, index_scale: float, scale: float, grad_scale: float,
    query_offset: int = 0,
):
    """The dense warm-up's KL per query and its gradient (same return as `indexer_loss_reference`).

    The queries sit at positions query_offset + [0, T) of the sequence kv and pool_keys cover (a
    piece of it under context parallelism). O(T^2 (H Dl + Hi Di)) work: meant for short contexts.
    Chunked over queries so that the largest tensor is [B, chunk, H, T] scores, never [T x T].
    """
    batch, seq, heads, _ = q.shape
    n_pools = pool_keys.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * seq * max(heads, index_q.shape[2])))
    dtype = wide(index_q.dtype)
    kl = torch.zeros(batch, seq, dtype=dtype, device=q.device)
    d_iq = torch.zeros(index_q.shape, dtype=dtype, device=q.device)
    d_pk = torch.zeros(pool_keys.shape, dtype=dtype, device=q.device)
    d_w = torch.zeros(head_weights.shape, dtype=dtype, device=q.device)
    kv_wide = kv.to(wide(q.dtype))  # once, not once per query chunk
    for t0 in range(0, seq, step):
        t1 = min(seq, t0 + step)
        target, valid = dense_target(q[:, t0:t1], kv_wide, query_offset + t0, scale=scale, kpool=kpool)
        visible = min(valid.shape[-1], n_pools)
        kl[:, t0:t1], d_iq[:, t0:t1], pk, d_w[:, t0:t1] = kl_and_grads(
            index_q[:, t0:t1], pool_keys, head_weights[:, t0:t1], None, valid[..., :visible], target[..., :visible],
            index_scale=index_scale, grad_scale=grad_scale,
        )
        d_pk += pk
    return kl, d_iq.to(index_q.dtype), d_pk.to(pool_keys.dtype), d_w.to(head_weights.dtype)


# ------------------------------------------------------------------------ how the loss trains

# Queries per block of the sparse KL's query subset. Each chosen block is a contiguous slice of the
# layer's saved tensors (a view, no copy of q's heads x latent per query), adjacent chosen blocks
# merge into one op call, and a block is a multiple of every pool size. Smaller blocks spread the scored queries more evenly over the window: on the CPU
# (benchmarks indexer_subset, F = 0.25, 6 seeds) the indexer's recall after 300 steps trailed F = 1's
# by 0.011 with 64 blocks a sequence, 0.022 with 16 and 0.036 with 4. 2048 gives 64 blocks at 128k
# and 256 at 512k, while the op's calls per layer stay at most F x T / 2048 (64 at 512k, F = 0.25),
# each of 2048 queries or more. A sequence shorter than a block is one block.
QUERY_BLOCK = 2048


def scored_blocks(length: int, fraction: float, *, block: int, seed: int, step: int, layer: int) -> list[int]:
    """The query blocks a layer takes its sparse KL over this step, sorted: block b holds the
    positions [b * block, min((b + 1) * block, length)) of the whole sequence; ceil(fraction *
    n_blocks) of the n_blocks = ceil(length / block) are drawn without replacement by a generator
    seeded from (seed, step, layer), so every rank and piece of the sequence, and a resumed run,
    draws the same ones. fraction 1: every block."""
    n_blocks = max(1, -(-length // block))
    # The tolerance keeps float products like 0.1 * 30 = 3.0000000000000004 from rounding up a block.
    chosen = min(n_blocks, max(1, math.ceil(fraction * n_blocks - 1e-9)))
    if chosen == n_blocks:
        return list(range(n_blocks))
    # A string seed: Python hashes it with SHA-512, the same on every process whatever PYTHONHASHSEED.
    rng = random.Random(f"indexer-loss-queries/{seed}/{step}/{layer}")
    return sorted(rng.sample(range(n_blocks), chosen))


def block_runs(blocks: list[int], block: int, length: int) -> list[tuple[int, int]]:
    """Sorted block ids -> the position ranges [a, b) they cover, adjacent blocks merged."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        a, z = b * block, min(length, (b + 1) * block)
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], z)
        else:
            runs.append((a, z))
    return runs


@dataclass
class IndexerLossSwitch:
    """Set as `DSAAttention.indexer_loss` (by genolong/train/indexer.py) to train that layer's indexer.

    mode: SPARSE (KL over the selected pools, its gradient added during the layer's backward) or
    DENSE (warm-up: KL against dense attention, computed and back-propagated into the indexer
    during the forward, which must run under torch.no_grad: the main model is frozen).
    coeff: the loss weight. weight: this micro-batch's share of the optimizer step (1/grad_accum).
    Each layer's loss is the mean KL over the micro-batch's scored queries, so its scale does not
    depend on the length; `values` accumulates weight * mean KL per layer: the step's mean.
    query_fraction: the share of query blocks (of `query_block` queries) the sparse KL scores,
    drawn per layer from (seed, step) by `scored_blocks`; 1 scores all B*T queries. The dense
    warm-up always scores every query.
    """

    mode: str
    coeff: float
    weight: float = 1.0
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    query_fraction: float = 1.0
    query_block: int | None = None  # None: QUERY_BLOCK
    seed: int = 0
    step: int = 0

    def scored_runs(self, layer_idx: int, length: int) -> list[tuple[int, int]]:
        """The whole sequence's query ranges [a, b) the sparse KL scores in this layer this step."""
        block = self.query_block or QUERY_BLOCK
        blocks = scored_blocks(length, self.query_fraction, block=block, seed=self.seed, step=self.step, layer=layer_idx)
        return block_runs(blocks, block, length)

    def record(self, layer_idx: int, kl_sum: torch.Tensor, n_queries: int) -> None:
        value = kl_sum.detach().float() * (self.weight / n_queries)
        self.values[layer_idx] = value if layer_idx not in self.values else self.values[layer_idx] + value

    def grad_scale(self, n_queries: int) -> float:
        return self.coeff * self.weight / n_queries


# Queries per step of the sparse loss's backward: the indexer's projections are recomputed for
# this many queries at a time (glm53-mini: index_q 32 MiB), so they never exist for all 512k.
LOSS_QUERY_CHUNK = 32768


def sparse_loss_gradients(indexer, x, q_resid, q, kv, indices, lse, *, scale: float, grad_scale: float, piece=None, rows=None):
    """The sparse KL of one layer and the gradient of grad_scale * its sum for every parameter of
    `indexer` (None where unused) -> (KL summed over the scored queries, [gradients]).

    rows: the ranges [a, b) of this call's queries (indices into q's dim 1) to score; None: all.
    The pooled keys are projected (and, with a piece, gathered) whatever rows says: every piece
    joins the gather, and each pool's gradient collects from the scored queries that selected it.

    The projections are recomputed here from the layer's (detached) x and q_resid, the queries'
    in chunks of LOSS_QUERY_CHUNK: nothing of the indexer is kept from the forward, and the largest
    indexer tensor alive is one chunk's, plus the pooled keys' small graph. With a `piece` (context
    parallelism) the pooled keys are the whole sequence's, gathered with their gradient going back
    to each piece's own pools; kv and indices are already the whole sequence's.
    """
    cfg, params = indexer.cfg, list(indexer.parameters())
    grads: list[torch.Tensor | None] = [None] * len(params)

    def add(new):
        for i, g in enumerate(new):
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g

    with torch.enable_grad():
        pool_keys = indexer.pool_keys(x)
        if piece is not None:
            pool_keys = piece.gather(pool_keys)
    d_pool_keys = torch.zeros(pool_keys.shape, dtype=wide(pool_keys.dtype), device=pool_keys.device)
    kl_sum = torch.zeros((), dtype=torch.float32, device=q.device)
    chunks = [(t0, min(b, t0 + LOSS_QUERY_CHUNK)) for a, b in (rows if rows is not None else [(0, q.shape[1])])
              for t0 in range(a, b, LOSS_QUERY_CHUNK)]
    for t0, t1 in chunks:
        with torch.enable_grad():
            index_q, head_weights = indexer.queries(x[:, t0:t1], q_resid[:, t0:t1])
        kl, d_iq, d_pk, d_w = ops.call(
            "dsa_indexer_loss", indexer.layer_idx, index_q.detach(), pool_keys.detach(), head_weights.detach(),
            q[:, t0:t1], kv, indices[:, t0:t1], lse[:, t0:t1],
            kpool=cfg.kpool, topk_pools=cfg.topk_pools, index_scale=indexer.softmax_scale, scale=scale, grad_scale=grad_scale,
        )
        add(torch.autograd.grad((index_q, head_weights), params, (d_iq, d_w), allow_unused=True))
        d_pool_keys += d_pk
        kl_sum = kl_sum + kl.sum()
    if not chunks:
        # A piece that scores no query still returns zeros (not None) for the query projections'
        # parameters, so every piece holds a gradient for the same parameters when they are summed.
        with torch.enable_grad():
            index_q, head_weights = indexer.queries(x[:, :1], q_resid[:, :1])  # (zero rows would not reshape)
        add(torch.autograd.grad((index_q, head_weights), params, (torch.zeros_like(index_q), torch.zeros_like(head_weights)),
                                allow_unused=True))
    add(torch.autograd.grad(pool_keys, params, d_pool_keys.to(pool_keys.dtype), allow_unused=True))
    return kl_sum, grads


class _AttachIndexerLoss(torch.autograd.Function):
    """Identity on the layer output; its backward also computes the layer's indexer loss and
    returns coeff * its gradient for the indexer's parameters (the trailing inputs). Computing it
    in backward (not forward) means once per step whether or not the layer is recomputed, nothing
    kept from the forward but what the layer keeps anyway, and no extra loss leaving the model."""

    @staticmethod
    def forward(ctx, out, x, q_resid, q, kv, indices, lse, spec, *params):
        ctx.save_for_backward(x, q_resid, q, kv, indices, lse)
        indexer, scale, switch, piece = spec
        # The scored blocks are the whole sequence's (kv's length), so pieces score exactly what
        # the whole-sequence layer scores and share its normalisation.
        runs = switch.scored_runs(indexer.layer_idx, kv.shape[1])
        n_queries = q.shape[0] * sum(b - a for a, b in runs)
        offset, seq = (0 if piece is None else piece.offset), q.shape[1]
        rows = [(max(a, offset) - offset, min(b, offset + seq) - offset) for a, b in runs if a < offset + seq and b > offset]
        # The loss's kernel runs in backward (autograd's own thread on CUDA): under the policy in force now.
        ctx.spec = (indexer, scale, switch, piece, rows, n_queries, switch.grad_scale(n_queries), ops.active())
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, q_resid, q, kv, indices, lse = ctx.saved_tensors
        indexer, scale, switch, piece, rows, n_queries, grad_scale, policy = ctx.spec
        with ops.policy(policy):
            kl_sum, grads = sparse_loss_gradients(
                indexer, x, q_resid, q, kv, indices, lse, scale=scale, grad_scale=grad_scale, piece=piece, rows=rows
            )
        switch.record(indexer.layer_idx, _over_pieces(kl_sum, piece), n_queries)
        return (grad_out, None, None, None, None, None, None, None, *grads)


def attach_indexer_loss(
    out, indexer, x, q_resid, q, kv, indices, lse, *, scale: float, switch: IndexerLossSwitch, piece=None
):
    """`out` unchanged; in backward, coeff * the sparse KL's gradient reaches `indexer`'s parameters.
    Its inputs are detached here: the KL trains the indexer and nothing upstream of it.

    With a `piece` (genolong/model/piece.py) x, q_resid, q and indices are this piece's queries, kv
    the whole sequence's; the KL is normalised over the whole sequence's scored queries and the
    recorded value is summed over the pieces, so every piece records the layer's mean."""
    return _AttachIndexerLoss.apply(
        out, x.detach(), q_resid.detach(), q.detach(), kv.detach(), indices, lse.detach(), (indexer, scale, switch, piece),
        *indexer.parameters(),
    )


def _over_pieces(value: torch.Tensor, piece) -> torch.Tensor:
    return value if piece is None else piece.total(value.detach())


def dense_warmup(indexer, x, q_resid, q, kv, *, scale: float, switch: IndexerLossSwitch, piece=None) -> torch.Tensor:
    """Warm-up: the dense KL's gradient goes into the indexer's .grad now; returns the top-k.
    `piece`: as `attach_indexer_loss` (kv is the whole sequence's)."""
    if torch.is_grad_enabled():
        raise GenolongError(
            "the dense indexer warm-up trains only the indexer: run the model forward under torch.no_grad() "
            "(genolong.train.indexer does), or use the sparse indexer loss"
        )
    offset = 0 if piece is None else piece.offset
    with torch.enable_grad():
        proj = indexer.project(x, q_resid, piece)
    n_queries = q.shape[0] * (q.shape[1] if piece is None else piece.length)
    kl, *grads = indexer_dense_loss(
        *proj, q, kv, kpool=indexer.cfg.kpool, index_scale=indexer.softmax_scale, scale=scale,
        grad_scale=switch.grad_scale(n_queries), query_offset=offset,
    )
    torch.autograd.backward(list(proj), grads)
    switch.record(indexer.layer_idx, _over_pieces(kl.sum(), piece), n_queries)
    return indexer.select(proj, query_offset=offset)
