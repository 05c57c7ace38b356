"""--parallel parsing and the checks that run before anything is allocated."""

import pytest

from genolong.errors import GenolongError
from genolong.model import get_preset
from genolong.parallel.layout import ParallelLayout, check_layout, parse_layout, required_multiple


def test_parse_any_order_and_defaults():
    assert parse_layout("cp=2") == ParallelLayout(cp=2)
    assert parse_layout(" tp=4, dp=2 ") == ParallelLayout(dp=2, tp=4)
    assert parse_layout(None) == ParallelLayout()
    assert parse_layout("dp=2,cp=2,tp=2,ep=2").world_size == 16
    assert parse_layout("dp=2,ep=4").data_parallel == 8


@pytest.mark.parametrize(
    "text, words",
    [
        ("cp2", "NAME=SIZE"),
        ("pp=2", "NAME=SIZE"),
        ("cp=2,cp=4", "twice"),
        ("cp=two", "whole number"),
        ("tp=0", "at least 1"),
    ],
)
def test_parse_rejects_with_the_fix(text, words):
    with pytest.raises(GenolongError, match=words) as err:
        parse_layout(text)
    assert "\n" not in str(err.value)


def test_world_size_must_match_the_processes_started():
    mini = get_preset("glm53-mini")
    with pytest.raises(GenolongError, match="needs 4 processes but 2 were started"):
        check_layout(parse_layout("cp=4"), mini, seq_len=1 << 20, batch=1, world_size=2)
    check_layout(parse_layout("cp=2"), mini, seq_len=1 << 20, batch=1, world_size=2)


def test_heads_experts_and_length_rules():
    mini = get_preset("glm53-mini")  # 4 KDA heads, 4 DSA heads, 64 experts, kpool 4
    with pytest.raises(GenolongError, match="4 KDA heads do not split evenly over 8"):
        check_layout(parse_layout("tp=8"), mini, seq_len=1 << 20, batch=1)
    with pytest.raises(GenolongError, match="64 routed experts do not split evenly over 3"):
        check_layout(parse_layout("ep=3"), mini, seq_len=1 << 20, batch=3)
    with pytest.raises(GenolongError, match="multiple of 128; use --seq 1024"):
        check_layout(parse_layout("cp=2"), mini, seq_len=1100, batch=1)
    with pytest.raises(GenolongError, match="--batch 1 sequences per step do not split over 2"):
        check_layout(parse_layout("dp=2"), mini, seq_len=4096, batch=1)
    check_layout(parse_layout("dp=2,cp=2,tp=2,ep=2"), mini, seq_len=1 << 20, batch=4)
    # Without cp or tp the sequence is not split: any length runs.
    check_layout(parse_layout("dp=2"), mini, seq_len=1100, batch=2)


def test_required_multiple_counts_chunks_pools_and_tp_shards():
    # lcm(64, 4) = 64 tokens per granule; cp shards of whole granules; tp splits each shard.
    assert required_multiple(ParallelLayout(), 4) == 64
    assert required_multiple(ParallelLayout(cp=4), 4) == 256
    assert required_multiple(ParallelLayout(cp=2, tp=2), 4) == 256
    assert required_multiple(ParallelLayout(cp=1), 16) == 64
    assert required_multiple(ParallelLayout(cp=1), 128) == 128


def test_a_model_without_moe_layers_refuses_ep():
    dense = get_preset("tiny", mlp_types=("dense",) * 4)
    with pytest.raises(GenolongError, match="no MoE layer"):
        check_layout(parse_layout("ep=2"), dense, seq_len=4096, batch=2)
