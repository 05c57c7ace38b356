"""DeepSeek Sparse Attention over NoPE MLA: the softmax-attention mixer of every fourth layer.

MLA keeps one normalised latent c_j [kv_lora_rank] per token; kv_b_proj expands it into each
head's key and value. Without rotary dimensions the key expansion can be folded into the query
("absorbed" form): q_h . (W_uk_h c_j) = (W_uk_h^T q_h) . c_j, so attention runs directly on the
latent, which serves as both key and value, and W_uv_h is applied to the attended latent
afterwards. That is the hot op "dsa_sparse_attention" (docs/ops.md), restricted per query to the
indexer's selection; `sparse_attention_reference` below is its oracle, chunked over queries.

Head counts come from the weights (kv_b_proj's rows), so a caller may run a subset of heads.

The indexer is frozen unless `indexer_loss` is set from outside (genolong/train/indexer.py):
then the layer also trains it with its KL loss (genolong/model/indexer_loss.py), and a
`recall_probe` measures how much dense attention the selection keeps.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from genolong.model import ops
from genolong.model.config import DSAConfig
from genolong.model.indexer import Indexer
from genolong.model.indexer_loss import DENSE, IndexerLossSwitch, attach_indexer_loss, dense_warmup
from genolong.model.indexer_recall import RecallProbe
from genolong.model.norms import RMSNorm
from genolong.model.piece import SequencePiece
# (registering how a recompute replays the two ops from their kept results: genolong.train.keep)
from genolong.model import kept_selection, sparse_replay  # noqa: F401

# Upper bound on gathered-latent elements per query chunk in the reference.
_GATHER_ELEMENTS = 1 << 24
# The dense form's score chunk on the CPU (4 MiB of fp32): larger ones cost memory passes and faults.
_CPU_DENSE_ELEMENTS = 1 << 20


def sparse_attention_reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, return_lse: bool = False
):
    """The "dsa_sparse_attention" op: q [B,T,H,Dl], kv [B,S,Dl], indices int32 [B,T,W] -> [B,T,H,Dl],
    and with `return_lse` also the natural-log log-sum-exp [B,T,H] (no gradient; fp32, or the
    input's dtype if wider).

    A query whose slots are all -1 attends to nothing and gets zeros (and lse -inf). A key listed
    twice in a query's slots counts twice (as a kernel gathering the slots would count it).

    Two formulations of the same sum, chosen by cost: gathering each query's W selected latents
    (the kernels' way; memory traffic B*T*W*Dl), or, when the selection is wide against the
    sequence (a short window with the full top-k, as in CPU training), dense scores against all S
    keys with the selection as a mask (B*T*S*H scores, one GEMM) -- at W = S with Dl = 64 and
    H = 4 the dense form moves ~16x less memory.
    """
    if _dense_is_cheaper(q, kv, indices):
        return _masked_dense_attention(q, kv, indices, scale=scale, return_lse=return_lse)
    return _gathered_attention(q, kv, indices, scale=scale, return_lse=return_lse)


def _dense_is_cheaper(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    heads, latent = q.shape[2], q.shape[3]
    width, keys = indices.shape[-1], kv.shape[1]
    # Gathered: W latents of Dl per query; dense: S scores per head per query (plus the mask).
    return width * latent > 2 * keys * (heads + 1)


def _gathered_attention(q, kv, indices, *, scale: float, return_lse: bool):
    batch, seq, _, latent = q.shape
    width = indices.shape[-1]
    step = max(1, _GATHER_ELEMENTS // max(1, batch * width * latent))
    outputs, lses = [], []
    for t0 in range(0, seq, step):
        idx = indices[:, t0 : t0 + step].long()
        rows = idx.shape[1]
        valid = idx >= 0
        gathered = kv.gather(1, idx.clamp(min=0).reshape(batch, rows * width, 1).expand(-1, -1, latent))
        gathered = gathered.view(batch, rows, width, latent)
        scores = torch.matmul(q[:, t0 : t0 + step], gathered.transpose(-1, -2))  # [B, t, H, W]
        # Softmax in fp32 at least, like the reference's eager attention.
        scores = scores.to(torch.promote_types(q.dtype, torch.float32)) * scale
        scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
        outputs.append(torch.matmul(probs, gathered))
        if return_lse:
            lses.append(torch.logsumexp(scores.detach(), dim=-1))
    out = torch.cat(outputs, dim=1)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


def _masked_dense_attention(q, kv, indices, *, scale: float, return_lse: bool):
    """The same sum over all S keys, each key's score shifted by log(times it is selected): 0 for
    once, a huge negative for never, log 2 for a duplicate slot; chunked over queries (on the CPU
    in cache-sized chunks). A query with no selected key gets zeros and lse -inf, as in the gather."""
    batch, seq, heads, latent = q.shape
    keys = kv.shape[1]
    limit = _GATHER_ELEMENTS if q.device.type != "cpu" else _CPU_DENSE_ELEMENTS
    step = max(1, limit // max(1, batch * heads * keys))
    kv_t = kv.transpose(-1, -2)  # [B, Dl, S]
    wide = torch.promote_types(q.dtype, torch.float32)
    never = torch.finfo(wide).min  # finite, so that a row without keys stays finite (and is zeroed below)
    outputs, lses = [], []
    for t0 in range(0, seq, step):
        idx = indices[:, t0 : t0 + step].long()
        rows = idx.shape[1]
        counts = torch.zeros(batch, rows, keys + 1, dtype=wide, device=q.device)
        # Unused slots (-1) are counted in an extra column that is dropped.
        counts.scatter_add_(2, torch.where(idx >= 0, idx, keys), torch.ones_like(idx, dtype=wide))
        counts = counts[..., :keys]
        shift = torch.where(counts > 0, counts.log(), never).unsqueeze(2)  # [B, t, 1, S]
        has_key = (counts > 0).any(-1)  # [B, t]
        scores = torch.matmul(q[:, t0 : t0 + step].flatten(1, 2), kv_t).view(batch, rows, heads, keys)
        scores = torch.add(shift, scores.to(wide), alpha=scale)  # one pass: scale and mask
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs.flatten(1, 2), kv).view(batch, rows, heads, latent)
        outputs.append(out * has_key[:, :, None, None].to(out.dtype))
        if return_lse:
            lses.append(torch.logsumexp(scores.detach(), dim=-1).masked_fill(~has_key[..., None], float("-inf")))
    out = torch.cat(outputs, dim=1)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


ops.register("dsa_sparse_attention", ops.REFERENCE, sparse_attention_reference)


def dense_causal_attention(q: torch.Tensor, kv: torch.Tensor, *, scale: float, query_offset: int = 0) -> torch.Tensor:
    """Every query over every key at or before it (the indexer's dense warm-up runs the main path
    this way, as DeepSeek-V3.2 does): q [B,T,H,Dl] at positions query_offset + [0, T), kv [B,S,Dl]
    -> [B,T,H,Dl]; chunked over queries, each chunk against only the keys it can see."""
    batch, seq, heads, latent = q.shape
    keys = kv.shape[1]
    limit = _GATHER_ELEMENTS if q.device.type != "cpu" else _CPU_DENSE_ELEMENTS
    step = max(1, limit // max(1, batch * heads * keys))
    wide = torch.promote_types(q.dtype, torch.float32)
    outputs = []
    for t0 in range(0, seq, step):
        rows = min(step, seq - t0)
        pos = query_offset + t0 + torch.arange(rows, device=q.device)
        seen = min(keys, query_offset + t0 + rows)
        scores = torch.matmul(q[:, t0 : t0 + rows].flatten(1, 2), kv[:, :seen].transpose(-1, -2))
        scores = scores.view(batch, rows, heads, seen).to(wide) * scale
        future = torch.arange(seen, device=q.device)[None, :] > pos[:, None]  # [rows, seen]
        probs = torch.softmax(scores.masked_fill(future[None, :, None, :], float("-inf")), dim=-1).to(q.dtype)
        outputs.append(torch.matmul(probs.flatten(1, 2), kv[:, :seen]).view(batch, rows, heads, latent))
    return torch.cat(outputs, dim=1)


class DSAAttention(nn.Module):
    def __init__(self, hidden: int, cfg: DSAConfig, rms_eps: float, layer_idx: int, *, has_indexer: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qk_head_dim = cfg.qk_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=rms_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=rms_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, hidden, bias=bias)
        # A "shared" layer has no indexer (and no indexer weights in the checkpoint).
        self.indexer = Indexer(hidden, cfg.q_lora_rank, cfg.indexer, layer_idx) if has_indexer else None
        # Set from outside (genolong/train/indexer.py), None by default: the indexer is frozen and
        # the layer does exactly what it did before the indexer could learn.
        self.indexer_loss: IndexerLossSwitch | None = None
        self.recall_probe: RecallProbe | None = None
        # The copy curriculum's oracle (genolong/train/copy_oracle.py): [B, T] key positions, -1 = none.
        self.selection_oracle: torch.Tensor | None = None
        # The indexer's dense warm-up (genolong/train/indexer.py): every query attends to every earlier key.
        self.dense_attention = False

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_uk [H, Dqk, Dl] and W_uv [H, Dv, Dl]."""
        w = self.kv_b_proj.weight.view(-1, self.qk_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_head_dim], w[:, self.qk_head_dim :]

    def forward(
        self, x: torch.Tensor, topk: torch.Tensor | None = None, *, piece: SequencePiece | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B,T,hidden] -> (output [B,T,hidden], the top-k indices used). `topk` is required
        exactly when this layer has no indexer of its own.

        `piece` (context parallelism, genolong/model/piece.py): x holds the tokens at positions
        piece.offset + [0, T) of longer sequences. The queries stay this piece's; the keys (the
        latent and the indexer's pooled keys) are gathered over the whole sequence, so the
        selections and outputs are those of the whole-sequence layer for these queries."""
        batch, seq = x.shape[:2]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(batch, seq, -1, self.qk_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        if piece is not None:
            latent = piece.gather(latent)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("bthd,hdl->bthl", q, w_uk)
        switch = self.indexer_loss if self.indexer is not None else None
        if self.indexer is None:
            if topk is None:
                raise ValueError(
                    f"layer {self.layer_idx}: a shared-indexer DSA layer needs the previous full layer's top-k"
                )
        elif switch is not None and switch.mode == DENSE:
            topk = dense_warmup(self.indexer, x, q_resid, q_latent, latent, scale=self.scale, switch=switch, piece=piece)
        elif piece is None:  # (a tensor-parallel indexer overrides forward(x, q_resid) without a piece)
            topk = self.indexer(x, q_resid)
        else:
            topk = self.indexer(x, q_resid, piece=piece)
        if self.selection_oracle is not None and self.indexer is not None:
            # The oracle covers whole sequences; a piece (a tile of the sequence-tiling pass) takes its queries' part.
            offset = 0 if piece is None else piece.offset
            keys = self.selection_oracle[:, offset : offset + seq]
            cfg = self.indexer.cfg
            topk = add_oracle_pools(topk, keys, kpool=cfg.kpool, topk_pools=cfg.topk_pools, query_offset=offset)
        if self.recall_probe is not None and self.indexer is not None:
            self.recall_probe.measure(
                self.layer_idx, q_latent, latent, topk, scale=self.scale, width=self.indexer.cfg.width, piece=piece
            )
        # The sparse indexer loss needs the attention's lse, and a backward to run in.
        sparse_loss = switch is not None and switch.mode != DENSE and torch.is_grad_enabled()
        if self.dense_attention:
            offset = 0 if piece is None else piece.offset
            o_latent = dense_causal_attention(q_latent, latent, scale=self.scale, query_offset=offset)
        elif sparse_loss:
            o_latent, lse = ops.call("dsa_sparse_attention", self.layer_idx, q_latent, latent, topk, scale=self.scale, return_lse=True)
        else:
            o_latent = ops.call("dsa_sparse_attention", self.layer_idx, q_latent, latent, topk, scale=self.scale)
        o = torch.einsum("bthl,hvl->bthv", o_latent, w_uv).reshape(batch, seq, -1)
        out = self.o_proj(o)
        if sparse_loss:
            out = attach_indexer_loss(
                out, self.indexer, x, q_resid, q_latent, latent, topk, lse, scale=self.scale, switch=switch, piece=piece
            )
        return out, topk


def add_oracle_pools(topk: torch.Tensor, keys: torch.Tensor, *, kpool: int, topk_pools: int, query_offset: int = 0) -> torch.Tensor:
    """topk int32 [B, T, W] (the indexer's selection: topk_pools pools of kpool keys, then the tail)
    with each query's oracle pool (keys [B, T], -1 = none) written over its last pool slots where the
    needed key is neither selected already nor in the query's incomplete tail pool. The queries sit
    at positions query_offset + [0, T)."""
    if topk_pools < 1:
        return topk
    seq = topk.shape[1]
    t = query_offset + torch.arange(seq, device=topk.device)
    tail_start = (t + 1) - (t + 1) % kpool
    keys = keys.to(topk.device)
    pooled = topk[..., : topk_pools * kpool]
    present = (pooled == keys.unsqueeze(-1).to(topk.dtype)).any(-1)
    write = (keys >= 0) & (keys < tail_start) & ~present
    pool_keys = (keys.clamp(min=0) // kpool * kpool).unsqueeze(-1) + torch.arange(kpool, device=topk.device)
    last = slice((topk_pools - 1) * kpool, topk_pools * kpool)
    out = topk.clone()
    out[..., last] = torch.where(write.unsqueeze(-1), pool_keys.to(topk.dtype), topk[..., last])
    return out
