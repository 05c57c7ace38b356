"""The indexer's chunked and two-pass selections against the model's reference, on the CPU."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from genolong.kernels import _common
from genolong.kernels.indexer import topk as it
from genolong.model.indexer import indexer_topk_reference


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def _inputs(batch, seq, heads, dim, kpool, seed):
    g = torch.Generator().manual_seed(seed)
    # Positive-mean q and keys keep every q.K above zero, so relu never flattens scores into ties.
    q = torch.randn(batch, seq, heads, dim, generator=g) * 0.3 + 1.0
    keys = torch.randn(batch, seq // kpool, dim, generator=g) * 0.3 + 1.0
    w = torch.randn(batch, seq, heads, generator=g) * heads**-0.5
    return q, keys, w


def _as_sets(x):
    return [[set(row.tolist()) - {-1} for row in b] for b in x]


CASES = [  # (seq, kpool, topk_pools, tail): sparse, early queries with fewer pools than top-k, no tail, kpool 1
    (203, 4, 8, True),
    (160, 4, 64, True),
    (96, 2, 5, False),
    (70, 1, 9, True),
]


def _run(impl, q, keys, w, **kw):
    # A tiny budget forces many query chunks (the minimum, 64 rows).
    if impl == "chunked":
        return it.indexer_chunked(q, keys, w, budget_bytes=1, **kw)
    if impl.startswith("fused_select"):
        return it.indexer_fused_select(q, keys, w, group=int(impl[-1]), budget_bytes=1, **kw)
    if impl.startswith("fused_super"):
        return it.indexer_fused_select(q, keys, w, group=int(impl[-1]), budget_bytes=1, group_max=it.group_max_super_torch,
                                       select_groups=it.select_groups_super_torch, **kw)
    return it.indexer_two_pass(q, keys, w, group=int(impl[-1]), budget_bytes=1, **kw)


IMPLS = ["chunked", "two_pass_g4", "two_pass_g8", "fused_select_g4", "fused_select_g8", "fused_super_g2", "fused_super_g4"]


@pytest.mark.parametrize("seq,kpool,topk,tail", CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_selection_equals_reference(seq, kpool, topk, tail, impl):
    q, keys, w = _inputs(2, seq, 4, 32, kpool, seed=seq + topk)
    kw = dict(kpool=kpool, topk_pools=topk, always_select_tail=tail, softmax_scale=32**-0.5)
    ref = indexer_topk_reference(q, keys, w, **kw)
    got = _run(impl, q, keys, w, **kw)
    assert got.dtype == torch.int32 and got.shape == ref.shape
    assert (got != _common.POISON_INT).all()
    assert _as_sets(got) == _as_sets(ref)
    # Every slot is -1 or a causal token index, with no duplicates in a row.
    t = torch.arange(seq)[None, :, None]
    assert ((got == -1) | ((got >= 0) & (got <= t))).all()
    assert all(len(r) == int((row >= 0).sum()) for b, gb in zip(_as_sets(got), got) for r, row in zip(b, gb))


PIECES = [[203], [64, 139], [1, 100, 102], [50, 50, 50, 53]]


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_pieces_with_their_offset_select_like_the_whole_sequence(pieces, impl):
    # Context parallelism: each piece's queries, placed by query_offset, against the whole
    # sequence's pools (including pools after the piece) select what the whole sequence selects.
    seq, kpool = sum(pieces), 4
    q, keys, w = _inputs(1, seq, 4, 32, kpool, seed=len(pieces))
    kw = dict(kpool=kpool, topk_pools=8, always_select_tail=True, softmax_scale=32**-0.5)
    whole = indexer_topk_reference(q, keys, w, **kw)
    parts, start = [], 0
    for n in pieces:
        sl = slice(start, start + n)
        if impl == "reference":
            parts.append(indexer_topk_reference(q[:, sl], keys, w[:, sl], query_offset=start, **kw))
        else:
            parts.append(_run(impl, q[:, sl], keys, w[:, sl], query_offset=start, **kw))
        start += n
    got = torch.cat(parts, dim=1)
    assert (got != _common.POISON_INT).all()
    assert _as_sets(got) == _as_sets(whole)
    # The last piece's rows hold global positions: its first query's tail pool starts at its offset's pool.
    last = pieces[-1]
    assert int(got[0, seq - last].max()) > seq - last - kpool


def test_offset_hides_pools_the_queries_cannot_see_yet():
    # Keys past the queries' positions are passed but never selected, whatever their scores.
    q, keys, w = _inputs(1, 64, 4, 32, 4, seed=9)
    keys = torch.cat([keys, torch.full((1, 100, 32), 50.0)], dim=1)  # pools 16..115: huge scores
    kw = dict(kpool=4, topk_pools=4, always_select_tail=True, softmax_scale=32**-0.5)
    for impl in ["reference", *IMPLS]:
        if impl == "reference":
            got = indexer_topk_reference(q, keys, w, query_offset=0, **kw)
        else:
            got = _run(impl, q, keys, w, query_offset=0, **kw)
        assert int(got.max()) < 64, impl


def test_two_pass_needs_every_pool_of_the_chosen_groups():
    # Rescoring only the best pool of each chosen group is a different (wrong) selection: the
    # comparison above can fail.
    q, keys, w = _inputs(1, 512, 4, 32, 4, seed=3)
    kw = dict(kpool=4, topk_pools=16, always_select_tail=True, softmax_scale=32**-0.5)
    ref = indexer_topk_reference(q, keys, w, **kw)

    def first_pool_only(q, keys, w, t, gidx, gval, *, kpool, scale, group):
        s = it.candidate_scores_torch(q, keys, w, t, gidx, gval, kpool=kpool, scale=scale, group=group)
        s.view(s.shape[0], -1, group)[..., 1:] = float("-inf")
        return s

    got = it.indexer_two_pass(q, keys, w, group=4, candidate_scores=first_pool_only, **kw)
    assert _as_sets(got) != _as_sets(ref)


def test_super_groups_need_every_group_of_the_chosen_super_groups():
    # Keeping only the best group of each chosen super-group is a different (wrong) selection:
    # the comparison with the reference can fail.
    q, keys, w = _inputs(1, 2048, 4, 32, 4, seed=4)
    kw = dict(kpool=4, topk_pools=16, always_select_tail=True, softmax_scale=32**-0.5)
    ref = indexer_topk_reference(q, keys, w, **kw)

    def best_group_only(maxima, topk_pools):
        gmax, sg, _ = maxima
        top = sg.topk(topk_pools, dim=-1, sorted=False)
        gid = (top.indices.unsqueeze(-1) * 8 + torch.arange(8)).flatten(1).clamp(max=gmax.shape[1] - 1)
        best = gmax.gather(1, gid).view(gmax.shape[0], topk_pools, 8).argmax(-1)
        return top.indices * 8 + best, top.values

    good = it.indexer_fused_select(q, keys, w, group=2, group_max=it.group_max_super_torch,
                                   select_groups=it.select_groups_super_torch, **kw)
    bad = it.indexer_fused_select(q, keys, w, group=2, group_max=it.group_max_super_torch, select_groups=best_group_only, **kw)
    assert _as_sets(good) == _as_sets(ref)
    assert _as_sets(bad) != _as_sets(ref)


def test_chunk_rows_follow_the_budget_not_the_length():
    budget = 2 << 30
    for seq in (16 * 1024, 256 * 1024, 1024 * 1024):
        pools = seq // 4
        per_row = pools // it.GROUP * 8 + 512 * (it.GROUP * 4 + 24) + 2051 * 8
        rows = it.chunk_rows(per_row, budget)
        assert rows % it.MIN_CHUNK == 0 and rows * per_row <= budget
    # At 1M tokens the chunk is still thousands of queries, not a handful.
    assert it.chunk_rows(1024 * 1024 // 4 // it.GROUP * 8 + 512 * 56 + 2051 * 8, budget) >= 4096


def test_expand_pools_layout():
    pools = torch.tensor([[2, -1], [0, 1]])
    out = it.expand_pools(pools, torch.tensor([13, 10]), kpool=4, topk_pools=2, always_select_tail=True)
    assert out.tolist() == [[8, 9, 10, 11, -1, -1, -1, -1, 12, 13, -1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


_INTERPRETED = """
import torch
from genolong.kernels.indexer import topk as it
from genolong.kernels.indexer import triton_kernels as tr
from genolong.model.indexer import indexer_topk_reference
g = torch.Generator().manual_seed(0)
seq, kpool = 600, 4
q = (torch.randn(1, seq, 4, 32, generator=g) * 0.3 + 1.0).half()
keys = (torch.randn(1, seq // kpool, 32, generator=g) * 0.3 + 1.0).half()
w = torch.randn(1, seq, 4, generator=g)
kw = dict(kpool=kpool, topk_pools=12, always_select_tail=True, softmax_scale=32**-0.5)
ref = indexer_topk_reference(q, keys, w, **kw)
sets = lambda x: [set(r) - {-1} for r in x[0].tolist()]
v1 = it.indexer_two_pass(q, keys, w, budget_bytes=1, group_max=tr.group_max, candidate_scores=tr.candidate_scores, **kw)
print("V1 MISMATCHED", sum(a != b for a, b in zip(sets(v1), sets(ref))))
# v2 in two pieces at their offsets (small tiles so that several pool blocks and programs run).
# v2 with groups of 2 pools and super-groups of 2 groups (dozens of super-groups against top 4 at
# these lengths, so that every selection level really chooses), small tiles so that several pool
# blocks and programs run; the last 300 queries, in two pieces at their offsets.
# Pass 1 has two kernels (q blocks of every head held for the program, or streamed head by head):
# the first piece runs one, the second the other.
kw4 = dict(kw, topk_pools=4)
ref4 = indexer_topk_reference(q, keys, w, **kw4)
v2 = lambda a, b, resident: it.indexer_fused_select(
    q[:, a:b], keys, w[:, a:b], query_offset=a, budget_bytes=1, group=2,
    group_max=lambda *x, **k: tr.group_max_v2(*x, sup=2, bm=16, bn=16, n_inner=2, stages=2, resident=resident, **k),
    select_groups=tr.select_groups, select=tr.select_candidates, **kw4)
got = torch.cat([v2(300, 420, True), v2(420, seq, False)], dim=1)
print("V2 MISMATCHED", sum(a != b for a, b in zip(sets(got), sets(ref4[:, 300:]))), "UNWRITTEN", int((got == -7).sum()))
# Its rows ascend apart from empty slots, so the sparse backward's key-chunked pass walks them unsorted.
from genolong.kernels.sparse_mla.op import key_chunk_rows
rows = got[0].contiguous()
print("V2 ASCENDING", key_chunk_rows(rows, torch.tensor([0, seq], dtype=torch.int32))[0] is rows)
# Every pool scores the same: each level's tie-break must still pick exactly min(topk, visible)
# distinct visible pools per query (96 queries: 6 super-groups of 4 pools against top 4).
tied = keys[:, :1].expand_as(keys).contiguous()
got = it.indexer_fused_select(q[:, :96], tied, w[:, :96], budget_bytes=1, group=2,
                              group_max=lambda *x, **k: tr.group_max_v2(*x, sup=2, bm=16, bn=16, n_inner=2, stages=2, **k),
                              select_groups=tr.select_groups, select=tr.select_candidates, **kw4)
ok = all(len({x // kpool for x in r[:16] if x >= 0}) == min(4, (t + 1) // kpool) and all(x <= t for x in r if x >= 0)
         for t, r in enumerate(got[0].tolist()))
print("TIES OK", ok)
# Pass 1's maxima themselves, both kernels, against the PyTorch pass 1 on the same fp16 inputs.
t = torch.arange(300, seq)
want = it.group_max_super_torch(q[0, 300:].float(), keys[0].float(), w[0, 300:], t, kpool=kpool, scale=32**-0.5, group=2, sup=2)
for resident in (True, False):
    got = tr.group_max_v2(q[0, 300:], keys[0], w[0, 300:], t, kpool=kpool, scale=32**-0.5, group=2, sup=2, bm=16, bn=16,
                          n_inner=2, stages=2, resident=resident)
    for a, b in zip(got[:2], want[:2]):
        same_inf = torch.equal(torch.isinf(a), torch.isinf(b))
        close = torch.allclose(a[b.isfinite()], b[b.isfinite()], rtol=0, atol=1e-5 * float(b[b.isfinite()].abs().max()))
        print("PASS1", "resident" if resident else "streamed", "OK" if same_inf and close else "DIFFERS")
"""


@pytest.mark.slow(seconds=45)  # ~1 min of CPU: each v2 selection runs up to 32 search steps, element by element, in the interpreter
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_passes_in_the_interpreter_select_like_the_reference():
    # Triton's CPU interpreter runs the kernels' own code (fp16: the interpreter has no bf16).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    prelude = "from genolong.kernels import _common; _common.POISON = True\n"
    run = subprocess.run([sys.executable, "-c", prelude + _INTERPRETED], env=env, capture_output=True, text=True, timeout=1500)
    assert "V1 MISMATCHED 0" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "V2 MISMATCHED 0 UNWRITTEN 0" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "TIES OK True" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "V2 ASCENDING True" in run.stdout, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("PASS1 resident OK") == 2 and run.stdout.count("PASS1 streamed OK") == 2, run.stdout + run.stderr[-3000:]


def test_query_positions_carry_their_start_to_the_host_without_a_device_read():
    from genolong.kernels import _common

    t = _common.positions(5, 3, "meta")  # a meta tensor has no values: reading t[0] would fail
    assert t.shape == (3,) and _common.first_position(t) == 5
    assert _common.first_position(torch.arange(7, 9)) == 7  # a caller's own positions are read
    assert _common.first_position(_common.positions(5, 3, "cpu")[1:]) == 6  # a view is read, not trusted
    chunks = list(it.query_chunks(10, 4, 100, 50, 4, "meta"))
    assert [_common.first_position(t) for _, _, t, _ in chunks] == [100, 104, 108]
