"""The whole model on CPU: presets build, `tiny` trains at several lengths, outputs are causal."""

import time

import pytest
import torch

from genolong.model import PRESETS, GenoLongForCausalLM, get_preset
from genolong.model.config import LAYER_DSA, MLP_DENSE
from genolong.vocab import DNA_MODEL_VOCAB_SIZE


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return GenoLongForCausalLM(get_preset("tiny"))


@pytest.mark.parametrize("seq", [128, 1000, 2048])
def test_tiny_forward_backward_at_several_lengths(tiny_model, seq):
    tiny_model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 5, (1, seq), generator=torch.Generator().manual_seed(seq))
    start = time.perf_counter()
    logits = tiny_model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    elapsed = time.perf_counter() - start
    print(f"\ntiny forward+backward at {seq} tokens: {elapsed:.2f} s")
    assert logits.shape == (1, seq, DNA_MODEL_VOCAB_SIZE)
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(8.0)).item()) < 0.5
    assert all(torch.isfinite(p.grad).all() for p in tiny_model.parameters() if p.grad is not None)
    # About 2 s at 2k tokens on one core; the bound is loose for a shared CI machine.
    assert elapsed < 60


def test_logits_are_causal(tiny_model):
    """Changing token t changes no output before t (conv, KDA, indexer pools and tail, attention)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (1, 200), generator=gen)
    changed = ids.clone()
    changed[0, 150:] = (changed[0, 150:] + 1) % 5
    with torch.no_grad():
        a, b = tiny_model(ids).logits, tiny_model(changed).logits
    assert torch.equal(a[:, :150], b[:, :150])
    assert not torch.allclose(a[:, 150:], b[:, 150:])


def test_prefixes_give_the_same_logits_down_to_one_token(tiny_model):
    """Shorter than a pool, than the DSA width, than a KDA chunk: each prefix matches the full run."""
    ids = torch.randint(0, 5, (2, 120), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = tiny_model(ids).logits
        for seq in (1, 2, 3, 5, 35, 36, 64, 77):
            assert torch.allclose(tiny_model(ids[:, :seq]).logits, full[:, :seq], atol=1e-5), seq


def test_hidden_states_is_the_input_of_lm_head(tiny_model):
    ids = torch.randint(0, 5, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = tiny_model.hidden_states(ids)
        logits = tiny_model(ids).logits
    assert hidden.shape == (2, 64, tiny_model.config.hidden)
    assert torch.allclose(tiny_model.lm_head(hidden), logits)


def test_batch_rows_are_independent(tiny_model):
    ids = torch.randint(0, 5, (3, 90), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batched = tiny_model(ids).logits
        single = tiny_model(ids[1:2]).logits
    assert torch.allclose(batched[1:2], single, atol=1e-5)


def test_tiny_overfits_one_sequence():
    """A model that can learn: 30 Adam steps on one sequence drive its loss well down."""
    torch.manual_seed(4)
    model = GenoLongForCausalLM(get_preset("tiny"))
    ids = torch.randint(0, 5, (1, 256), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"\noverfit loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_without_allocating(name):
    config = get_preset(name)
    with torch.device("meta"):
        model = GenoLongForCausalLM(config)
    assert len(model.model.layers) == config.num_layers
    assert model.lm_head.weight.shape == (config.vocab_size, config.hidden)
    for i, layer in enumerate(model.model.layers):
        assert (layer.kind == LAYER_DSA) == (i % 4 == 3)
        assert (config.mlp_types[i] == MLP_DENSE) == (i < 3)


def test_published_architecture_numbers():
    flash = get_preset("glm-5.3-flash")
    assert (flash.num_layers, flash.hidden, flash.vocab_size, flash.rms_eps) == (45, 4096, 154_880, 1e-5)
    assert len(flash.dsa_layers) == 11 and flash.dsa_layers[0] == 3 and flash.dsa_layers[-1] == 43
    assert (flash.kda.num_heads, flash.kda.head_dim, flash.kda.conv_kernel, flash.kda.lower_bound) == (64, 128, 4, -5.0)
    d = flash.dsa
    assert (d.num_heads, d.q_lora_rank, d.kv_lora_rank, d.qk_head_dim, d.v_head_dim) == (64, 1536, 512, 256, 256)
    ix, moe = d.indexer, flash.moe
    assert (ix.n_heads, ix.head_dim, ix.kpool, ix.topk, ix.width) == (32, 128, 4, 2048, 2051)
    assert (moe.num_experts, moe.top_k, moe.expert_dim, moe.num_shared_experts) == (288, 8, 2048, 1)
    assert (moe.routed_scaling_factor, moe.swiglu_limit, flash.dense_mlp.intermediate_size) == (2.5, 10.0, 12288)
    assert (flash.mhc.num_streams, flash.mhc.sinkhorn_iters) == (4, 20)

    mini = get_preset("glm53-mini")
    assert (mini.num_layers, mini.hidden, mini.vocab_size) == (45, 512, DNA_MODEL_VOCAB_SIZE)
    assert (mini.kda.num_heads, mini.kda.head_dim) == (4, 128)
    d = mini.dsa
    assert (d.num_heads, d.q_lora_rank, d.kv_lora_rank, d.qk_head_dim, d.v_head_dim) == (4, 384, 512, 128, 128)
    assert (d.indexer.n_heads, d.indexer.head_dim, d.indexer.kpool, d.indexer.topk) == (4, 128, 4, 2048)
    assert (mini.moe.num_experts, mini.moe.top_k, mini.moe.expert_dim, mini.moe.num_shared_experts) == (64, 4, 256, 1)
    assert mini.dense_mlp.intermediate_size == 1536 and mini.mhc.num_streams == 4


def test_depth_dial_rederives_the_schedule():
    config = get_preset("glm53-mini", num_layers=12)
    assert config.num_layers == 12 and config.dsa_layers == (3, 7, 11)
    assert config.mlp_types[:4] == ("dense", "dense", "dense", "moe") and len(config.indexer_types) == 12
