"""DNA-renormalised loss: equal to the full-logit computation, chunked or not, with or without a head bias."""

import pytest
import torch
import torch.nn.functional as F

from genolong.eval.dnaloss import auto_chunk_tokens, dna_token_loss


def full_logit_reference(hidden, weight, bias, base_rows, targets):
    """The plainest route: every logit of the vocabulary, then the four base columns."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp = F.log_softmax(logits[..., base_rows], dim=-1)
    picked = logp.gather(-1, targets.clamp(0, 3).unsqueeze(-1)).squeeze(-1)
    return torch.where((targets >= 0) & (targets < 4), -picked, 0.0)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_full_logit_computation(chunk, with_bias):
    gen = torch.Generator().manual_seed(0)
    vocab, d = 40, 24
    hidden = torch.randn(2, 50, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen)
    bias = torch.randn(vocab, generator=gen) if with_bias else None
    base_rows = [33, 5, 17, 2]  # a text vocabulary: the bases anywhere, in A, C, G, T order
    targets = torch.randint(0, 5, (2, 50), generator=gen)  # 4 = N: not scored
    targets[0, :3] = -100
    got = dna_token_loss(hidden, weight[base_rows], targets, chunk, bias[base_rows] if with_bias else None)
    expect = full_logit_reference(hidden, weight, bias, base_rows, targets)
    assert got.dtype == torch.float32 and got.shape == (2, 50)
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.all(got[targets == 4] == 0) and torch.all(got[0, :3] == 0)


def test_bf16_hidden_states_are_scored_in_fp32():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 30, 16, generator=gen).bfloat16()
    weight = torch.randn(4, 16, generator=gen).bfloat16()
    targets = torch.randint(0, 4, (1, 30), generator=gen)
    got = dna_token_loss(hidden, weight, targets, 8)
    expect = full_logit_reference(hidden.float(), weight.float(), None, [0, 1, 2, 3], targets)
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5)


def test_uniform_logits_cost_exactly_two_bits():
    loss = dna_token_loss(torch.zeros(1, 5, 8), torch.zeros(4, 8), torch.tensor([[0, 1, 2, 3, 0]]), 2)
    torch.testing.assert_close(loss / torch.log(torch.tensor(2.0)), torch.full((1, 5), 2.0))


def test_bad_shapes_are_refused_and_chunks_are_sized_by_hidden():
    with pytest.raises(ValueError, match="head_rows"):
        dna_token_loss(torch.zeros(1, 5, 8), torch.zeros(5, 8), torch.zeros(1, 5, dtype=torch.long), 2)
    assert auto_chunk_tokens(4096) == (1 << 28) // (4 * 4096)
    assert auto_chunk_tokens(1 << 30) == 256
