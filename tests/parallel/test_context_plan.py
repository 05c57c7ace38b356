"""Context parallelism's bookkeeping without processes: the sharding, the refusals at config time,
and the zigzag plan of the indexer's scoring (every block scored once, equal work per rank)."""

import pytest
import torch

from genolong.errors import GenolongError
from genolong.model import get_preset
from genolong.parallel.context import shard_batch, shard_slice
from genolong.parallel.context_dsa import ZigzagPlan
from genolong.parallel.layout import ParallelLayout, check_layout, required_multiple, resolve_kda_mode


def test_contiguous_shards_in_rank_order():
    assert [shard_slice(1024, r, 4) for r in range(4)] == [slice(0, 256), slice(256, 512), slice(512, 768), slice(768, 1024)]
    tokens = torch.arange(9).unsqueeze(0)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    a = shard_batch(inputs, targets, targets != 3, 0, 2)
    b = shard_batch(inputs, targets, targets != 3, 1, 2)
    # Shifted before sharding: the last input of shard 0 keeps its target, the first token of shard 1.
    assert a[0].tolist() == [[0, 1, 2, 3]] and a[1].tolist() == [[1, 2, 3, 4]] and b[1].tolist() == [[5, 6, 7, 8]]
    assert a[2].tolist() == [[True, True, False, True]]


def test_sharding_refuses_what_does_not_split():
    with pytest.raises(GenolongError, match="does not split into 2 context shards of whole 64-token blocks; use a length that is a multiple of 128"):
        shard_slice(192, 0, 2, multiple=64)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(GenolongError, match="shift the targets by one before sharding"):
        shard_batch(ids, ids[:, 1:], ids > 0, 0, 2)


def test_check_layout_rules_for_cp():
    config = get_preset("tiny")  # 2 KDA heads, pools of 4
    assert required_multiple(ParallelLayout(cp=4), 4) == 256
    with pytest.raises(GenolongError, match="--seq 320 does not split into 4 context shard"):
        check_layout(ParallelLayout(cp=4), config, seq_len=320, batch=1)
    check_layout(ParallelLayout(cp=4), config, seq_len=512, batch=1)  # auto: state passing where heads do not split
    check_layout(ParallelLayout(cp=4), config, seq_len=512, batch=1, kda_mode="state")
    with pytest.raises(GenolongError, match="2 KDA heads do not split evenly over 4 ranks; use a cp that divides 2, or the state-passing"):
        check_layout(ParallelLayout(cp=4), config, seq_len=512, batch=1, kda_mode="ulysses")
    check_layout(ParallelLayout(cp=2), config, seq_len=512, batch=1, kda_mode="ulysses")
    with pytest.raises(GenolongError, match="'heads' is not one of auto, state, ulysses"):
        check_layout(ParallelLayout(cp=2), config, seq_len=512, batch=1, kda_mode="heads")


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_zigzag_plan_scores_every_block_once_with_equal_work(size):
    block = 16
    plans = [ZigzagPlan(r, size, block) for r in range(size)]
    scored = sorted(b for p in plans for b in p.received)
    assert scored == list(range(2 * size))
    # What r sends to s is what s receives from r.
    for r in range(size):
        for s in range(size):
            assert plans[r].send_counts[s] == plans[s].recv_counts[r]
            assert [b for b in plans[r].sent if b in plans[s].received] == [b for b in plans[s].received if b // 2 == r]
    # A block's scoring costs ~ its queries x the pools before them: block b ~ 2b + 1. Zigzag: 4 size per rank.
    work = [sum(2 * b + 1 for b in p.received) for p in plans]
    assert work == [4 * size] * size
    contiguous = [sum(2 * b + 1 for b in (2 * r, 2 * r + 1)) for r in range(size)]
    assert max(contiguous) == 8 * size - 4  # the last rank's (2 size - 1) / size^2 of the total 4 size^2


def test_zigzag_blocks_carry_their_query_offsets():
    plan = ZigzagPlan(1, 2, 3)  # rank 1 of 2 owns blocks 2, 3 and scores blocks 1 and 2
    t = torch.arange(2 * 6).view(2, 6)  # what arrived: [B, 2 blocks of 3] in `received` order
    blocks = list(plan.scored_blocks(t, t))
    assert plan.received == [1, 2] and [offset for _, _, offset in blocks] == [3, 6]
    assert torch.equal(torch.cat([q for q, _, _ in blocks], 1), t)


def test_auto_kda_mode_takes_ulysses_where_heads_divide():
    config = get_preset("tiny")  # 2 KDA heads
    assert [resolve_kda_mode(config, cp, "auto") for cp in (1, 2, 4)] == ["ulysses", "ulysses", "state"]
    assert resolve_kda_mode(config, 2, "state") == "state"
