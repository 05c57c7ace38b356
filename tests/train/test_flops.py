"""The FLOP formula: closed forms against brute force, sparse attention linear in T, recompute separate."""

import pytest

from genolong.model import get_preset
from genolong.model.param_count import param_count
from genolong.train import flops


@pytest.mark.parametrize("t", [1, 3, 4, 5, 17, 64, 1000])
@pytest.mark.parametrize("w", [1, 4, 2051])
def test_sum_min_matches_brute_force(t, w):
    assert flops._sum_min(t, w) == sum(min(i + 1, w) for i in range(t))


@pytest.mark.parametrize("t", [1, 3, 4, 5, 9, 17, 64, 1001])
@pytest.mark.parametrize("kpool", [1, 4, 16])
def test_sum_pools_matches_brute_force(t, kpool):
    assert flops._sum_pools(t, kpool) == sum((i + 1) // kpool for i in range(t))


def test_dsa_is_linear_in_t_beyond_topk_and_kda_is_linear():
    config = get_preset("glm-5.3-flash")
    a1, _ = flops.dsa_forward(config, 64 * 1024)
    a2, _ = flops.dsa_forward(config, 128 * 1024)
    # Sparse: every query past 2051 tokens attends to 2051 keys, so doubling T doubles the cost.
    assert a2 / a1 == pytest.approx(2.0, rel=0.02)
    assert flops.kda_forward(config, 2048) * 2 == pytest.approx(flops.kda_forward(config, 4096))


def test_indexer_scoring_is_the_causal_half_and_quadratic():
    config = get_preset("glm-5.3-flash")
    ix = config.dsa.indexer
    t = 512 * 1024
    _, index = flops.dsa_forward(config, t)
    scores = index - t * 2 * (config.dsa.q_lora_rank * ix.n_heads * ix.head_dim + config.hidden * ix.head_dim + config.hidden * ix.n_heads)
    half = t * (t / ix.kpool) / 2 * 2 * ix.n_heads * (ix.head_dim + 1)
    assert scores == pytest.approx(half, rel=1e-3)


def test_model_vs_hardware_flops():
    config = get_preset("tiny")
    t = 4096
    plain = flops.step_flops(config, t, recompute=False, chunked_loss=False)
    full = flops.step_flops(config, t, recompute=True, chunked_loss=True)
    assert plain.model == full.model == plain.hardware  # recompute never changes model FLOPs
    layers = sum(v for k, v in full.forward.items() if k != "lm_head")
    assert full.hardware - full.model == pytest.approx(layers + full.forward["lm_head"])
    trainable = sum(v for k, v in full.forward.items() if k != "indexer")
    assert full.model == pytest.approx(3 * trainable + full.forward["indexer"])  # frozen indexer: forward only
    assert full.scaled(3).model == pytest.approx(3 * full.model)
    chunked = flops.step_flops(config, t, recompute=True, moe_recompute=True)
    moe = sum(flops.mlp_forward(config, i, t) for i in config.moe_layers)
    assert chunked.hardware - full.hardware == pytest.approx(moe) and chunked.model == full.model


def test_moe_counts_active_experts_only():
    base = get_preset("tiny")
    more = get_preset("tiny", moe={"num_experts": 64})
    d = flops.mlp_forward(more, 3, 100) - flops.mlp_forward(base, 3, 100)
    assert d == pytest.approx(100 * 2 * base.hidden * (64 - 8))  # only the router grows


def test_short_sequence_matmul_flops_are_six_times_active_params():
    """At T=1 attention cores vanish: 3 x forward = 6 x active matmul parameters per token.

    Cross-check against genolong.model.param_count, computed independently from the architecture;
    the embedding (a lookup), the frozen indexer and vector parameters are not matmuls.
    """
    config = get_preset("glm-5.3-flash")
    counts = param_count(config)
    f = flops.step_flops(config, 1, recompute=False)
    counted = f.model - f.forward["indexer"]
    matmul_params = counts.active - counts.components["embedding"] - counts.components["dsa indexer"]
    assert counted / (6 * matmul_params) == pytest.approx(1.0, rel=0.02)


def test_peak_flops_by_device_name():
    assert flops.peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert flops.peak_flops(None) is None and flops.peak_flops("cpu thing") is None
