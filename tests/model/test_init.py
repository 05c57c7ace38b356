"""The LM head's initialisation: normal(0, 1 / hidden) (muP readout; docs/model.md "Initialisation")."""

import pytest
import torch

from genolong.model import GenoLongForCausalLM, get_preset


@pytest.mark.parametrize("hidden", [128, 512])
def test_lm_head_is_normal_with_std_one_over_hidden(hidden):
    torch.manual_seed(0)
    model = GenoLongForCausalLM(get_preset("tiny", hidden=hidden))
    head = model.lm_head.weight
    # vocab x hidden draws: the sample std is within a few percent of 1 / hidden.
    assert head.std().item() == pytest.approx(1.0 / hidden, rel=0.08)
    assert abs(head.mean().item()) < 6.0 / hidden / head.numel() ** 0.5  # zero mean, within 6 sigma
    # Not the reference's 0.02 (which is what spiked at lr 1e-3), and not tied to the embedding.
    assert head.std().item() < 0.5 * 0.02
    assert head.data_ptr() != model.model.embed_tokens.weight.data_ptr()
