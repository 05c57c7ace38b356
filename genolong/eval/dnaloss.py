"""Per-base loss with the model's probabilities renormalised over the four bases A, C, G, T.

A model's softmax runs over its whole vocabulary: 8 tokens for genolong's DNA vocabulary (3 of
them never occur), 154,880 for a GLM text checkpoint. Probability mass on tokens that cannot be
the next base is a cost the model pays for its vocabulary, not for its knowledge of DNA: a freshly
initialised DNA-vocabulary model scores log2(8) = 3 bits, a GLM checkpoint far more, and what
a fine-tune first "learns" is to stop predicting text. Evaluation therefore scores

    loss_t = -log p(x_t | x_<t, x_t in {A, C, G, T}) = logsumexp(z_A, z_C, z_G, z_T) - z_{x_t}

where z are the logits of the four base tokens (whatever their ids in the model's vocabulary).
Uniform guessing then costs exactly 2 bits per base for any model, and models with different
vocabularies are on one scale. N targets are not scored (the caller masks them).

Only four rows of the LM head are needed, so the [T, vocab] logits never exist; hidden states
are taken `chunk_tokens` at a time so that their fp32 copy stays small at 512k tokens. The plain
reference is the full-logit computation (model logits, keep four columns, log-softmax), which
tests/eval/test_dnaloss.py compares against.
"""

from __future__ import annotations

import torch

from genolong.vocab import DNA_BASES

N_SCORED = 4  # A, C, G, T: the targets that are scored
assert DNA_BASES[:N_SCORED] == ("A", "C", "G", "T")


def dna_token_loss(
    hidden: torch.Tensor,
    head_rows: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    head_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [B, T] loss in nats over {A, C, G, T}; targets are DNA ids (0-3), others give 0.

    hidden [B, T, D]; head_rows [4, D]: the LM-head rows of A, C, G, T in that order (bias [4]
    if the head has one).
    """
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, T, D] and targets [B, T]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if head_rows.shape != (N_SCORED, hidden.shape[-1]):
        raise ValueError(f"head_rows must be [{N_SCORED}, {hidden.shape[-1]}], got {tuple(head_rows.shape)}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    b, t, d = hidden.shape
    flat_h = hidden.reshape(b * t, d)
    flat_t = targets.reshape(b * t).long()
    # fp32 logits whatever the model dtype: four columns cost nothing, and bf16 logits would
    # round the differences between bases that the loss is made of.
    rows = head_rows.float()
    bias = head_bias.float() if head_bias is not None else None
    out = torch.empty(b * t, dtype=torch.float32, device=hidden.device)
    for s in range(0, b * t, chunk_tokens):
        e = min(s + chunk_tokens, b * t)
        logits = flat_h[s:e].float() @ rows.t()
        if bias is not None:
            logits = logits + bias
        tgt = flat_t[s:e]
        scored = (tgt >= 0) & (tgt < N_SCORED)
        picked = logits.gather(1, tgt.clamp(0, N_SCORED - 1).unsqueeze(1)).squeeze(1)
        out[s:e] = torch.where(scored, torch.logsumexp(logits, dim=-1) - picked, 0.0)
    return out.view(b, t)


def auto_chunk_tokens(hidden_size: int, budget_bytes: int = 1 << 28) -> int:
    """Tokens per chunk so that one chunk's fp32 hidden states take about `budget_bytes` (>= 256)."""
    return max(256, budget_bytes // (4 * hidden_size))
