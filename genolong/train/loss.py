"""The LM head and cross-entropy in sequence chunks: [T, vocab] logits never exist.

At 512k tokens and GLM's 154,880-token vocabulary, full fp32 logits would take 317 GiB (and
their gradient as much again). `chunked_token_loss` runs the head `chunk_tokens` tokens at a
time; a custom autograd Function keeps only the hidden states, the head weight, the targets and
one fp32 log-sum-exp per token, and recomputes each chunk's logits in backward. Peak extra
memory is one chunk's logits (chunk_tokens x vocab fp32, twice: logits and their gradient)
plus, for the weight gradient, one fp32 [vocab, hidden] accumulator, independent of T.

Loss normalisation, written down once (see docs/training.md):

    loss = sum over this rank's micro-batch of per-token loss at valid targets
           / number of valid targets in the WHOLE optimizer step (all micro-batches, all ranks)

A target is valid unless it is an N base (genolong.vocab.N_ID; N is a real input token but
there is nothing to predict). Every micro-batch and every data/context-parallel rank divides by
the same global count, so summing their gradients gives exactly the gradient of the mean over
all valid tokens of the step, however unevenly the N bases fall. Per-rank or per-micro-batch
means would weight a token by the inverse of its own shard's valid count. Callers that split a
step pass `global_valid_count`; without it the local count is used (one shard = the whole step).

Weighted targets (`target_weight`, e.g. soft-masked repeat bases at 0.1 as Evo 2 does): the loss
becomes the weighted mean, sum of weight * per-token loss / the step's global sum of weights, by
the same rule; N targets keep weight 0. `repeat_target_weight` builds those weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """per-token CE of (hidden @ weight.T) against targets, chunked over tokens; negative targets -> 0."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
        n = hidden.shape[0]
        acc = _acc_dtype(weight)
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            logits = (hidden[s:e] @ weight.t()).to(acc)
            tgt = targets[s:e]
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, tgt.clamp_min(0).unsqueeze(1)).squeeze(1)
            loss[s:e] = torch.where(tgt >= 0, lse[s:e] - picked, 0.0)
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulation over chunks: a bf16 running sum would drop small chunk contributions.
        acc = _acc_dtype(weight)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, n, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, n)
            h = hidden[s:e]
            tgt = targets[s:e]
            g = grad_loss[s:e].to(acc) * (tgt >= 0)
            # d loss_t / d logits_t = softmax_t - onehot(target_t), scaled by the incoming gradient.
            dlogits = (h @ weight.t()).to(acc).sub_(lse[s:e, None]).exp_().mul_(g[:, None])
            dlogits.scatter_add_(1, tgt.clamp_min(0).unsqueeze(1), -g.unsqueeze(1))
            dlogits = dlogits.to(weight.dtype)
            if need_h:
                grad_h[s:e] = dlogits @ weight
            if need_w:
                grad_w += _mm_acc(dlogits.t(), h, acc)
            del dlogits
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None


_MM_OUT_DTYPE_WORKS: bool | None = None


def _mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b as `acc`: on CUDA a bf16 GEMM with an fp32 output (no [V, D] bf16 temporary, no
    rounding of each chunk's contribution); elsewhere, or where that overload is missing, cast."""
    global _MM_OUT_DTYPE_WORKS
    if a.is_cuda and a.dtype != acc and _MM_OUT_DTYPE_WORKS is not False:
        try:
            out = torch.mm(a, b, out_dtype=acc)
            _MM_OUT_DTYPE_WORKS = True
            return out
        except (RuntimeError, NotImplementedError, TypeError):
            _MM_OUT_DTYPE_WORKS = False
    return (a @ b).to(acc)


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """Logits, softmax and weight-grad accumulation: fp32 for bf16/fp32 weights (fp64 stays fp64 for tests)."""
    return torch.promote_types(weight.dtype, torch.float32)


def chunked_token_loss(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Per-token cross-entropy, fp32 [B, T], of logits hidden @ W.T without materialising them.

    hidden [B, T, D]; lm_head_weight [V, D] (same dtype); targets [B, T] long. Targets < 0 give
    loss 0 and no gradient (callers mask N bases this way or by multiplying the result).
    """
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, T, D] and targets [B, T]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    b, t, d = hidden.shape
    flat = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(b * t, d), lm_head_weight, targets.reshape(b * t).long(), int(chunk_tokens)
    )
    return flat.view(b, t)


def chunked_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    valid_mask: torch.Tensor,
    chunk_tokens: int,
    global_valid_count: int | float | torch.Tensor | None = None,
    target_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of per-token loss over valid targets / global valid count (module docstring).

    With `target_weight` [B, T] (zero where not valid): sum of weight * loss / the global sum of
    weights, which the caller passes as `global_valid_count` when the step is split.
    """
    masked = torch.where(valid_mask, targets.long(), IGNORE)
    per_token = chunked_token_loss(hidden, lm_head_weight, masked, chunk_tokens)
    return _reduce(per_token, valid_mask, global_valid_count, target_weight)


def full_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    valid_mask: torch.Tensor,
    global_valid_count: int | float | torch.Tensor | None = None,
    target_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same loss with the full [B, T, vocab] logits: what an out-of-the-box stack does (--baseline)."""
    logits = (hidden @ lm_head_weight.t()).float()
    masked = torch.where(valid_mask, targets.long(), IGNORE)
    if target_weight is None:
        total = F.cross_entropy(logits.flatten(0, 1), masked.flatten(), ignore_index=IGNORE, reduction="sum")
        return total / _count(valid_mask, global_valid_count)
    per_token = F.cross_entropy(logits.flatten(0, 1), masked.flatten(), ignore_index=IGNORE, reduction="none")
    return _reduce(per_token.view(masked.shape), valid_mask, global_valid_count, target_weight)


def repeat_target_weight(valid_mask: torch.Tensor, repeat_mask: torch.Tensor, repeat_weight: float) -> torch.Tensor:
    """fp32 per-target weights: 0 for N, `repeat_weight` for soft-masked repeat bases, 1 otherwise."""
    weight = torch.where(repeat_mask, torch.tensor(float(repeat_weight)), torch.tensor(1.0))
    return torch.where(valid_mask, weight, torch.tensor(0.0)).to(device=valid_mask.device)


def _reduce(per_token: torch.Tensor, valid_mask: torch.Tensor, global_count, target_weight: torch.Tensor | None) -> torch.Tensor:
    if target_weight is None:
        return per_token.sum() / _count(valid_mask, global_count)
    if global_count is None:
        global_count = target_weight.sum(dtype=torch.float64)
    return (per_token * target_weight.to(per_token.dtype)).sum() / _weight_total(global_count)


def auto_chunk_tokens(vocab_size: int, budget_bytes: int = 1 << 30) -> int:
    """Tokens per loss chunk so that one chunk's fp32 logits take about `budget_bytes` (>= 256 tokens)."""
    return max(256, budget_bytes // (4 * vocab_size))


def _weight_total(total) -> torch.Tensor | float:
    # A step whose weights are all 0 (all N, or all repeats at weight 0) has a zero numerator too:
    # any positive floor gives loss 0 rather than 0/0, and a real total is never below it.
    tiny = torch.finfo(torch.float32).tiny
    if isinstance(total, torch.Tensor):
        return total.to(torch.float32).clamp_min(tiny)
    return max(float(total), tiny)


def _count(valid_mask: torch.Tensor, global_valid_count) -> torch.Tensor | int:
    count = valid_mask.sum() if global_valid_count is None else global_valid_count
    # A step with no valid target (an all-N window) gives loss 0 rather than 0/0 = NaN.
    return count.clamp_min(1) if isinstance(count, torch.Tensor) else max(int(count), 1)
