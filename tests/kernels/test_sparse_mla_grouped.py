"""The grouped sparse-MLA passes' host side (packing, chunk ranges, budget, configs) in plain
PyTorch, and their kernels built for sm_90 without a GPU. The kernels' results against the
reference run in Triton's interpreter in test_sparse_mla_triton.py (the "grouped" cases)."""

import importlib.util
from collections import Counter

import pytest
import torch

from genolong.errors import GenolongError
from genolong.kernels import sparse_mla
from genolong.kernels import sparse_mla_grouped as grouped
from genolong.model.ops import KernelUnsupported

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("query_group", [1, 4, 16])
def test_pack_puts_each_groups_keys_of_a_chunk_in_one_range(query_group):
    g = torch.Generator().manual_seed(query_group)
    seq_kv, key_chunk, n, width = 50, 16, 23, 9  # n not a multiple of the group; the last chunk partial
    idx = torch.randint(-3, seq_kv + 5, (n, width), generator=g, dtype=torch.int32)  # -3..-1 and >= S: empty
    idx[5] = -1
    idx[6, :4] = 7  # a key repeated in a row counts as often as it appears
    packed, bounds = grouped.pack(idx, query_group, seq_kv, key_chunk)
    groups, n_chunks = -(-n // query_group), -(-seq_kv // key_chunk)
    assert packed.dtype == bounds.dtype == torch.int32
    assert packed.shape == (groups, query_group * width) and bounds.shape == (groups, n_chunks + 1)
    for grp in range(groups):
        assert (packed[grp, : bounds[grp, 0]] == -1).all()  # empty slots sort first
        assert bounds[grp, -1] == query_group * width  # nothing valid past the last chunk
        for c in range(n_chunks):
            got = Counter((int(p) // query_group, int(p) % query_group) for p in packed[grp, bounds[grp, c] : bounds[grp, c + 1]])
            want = Counter((int(key), r) for r in range(query_group) if grp * query_group + r < n
                           for key in idx[grp * query_group + r] if c * key_chunk <= key < min(seq_kv, (c + 1) * key_chunk))
            assert got == want, (grp, c)


def test_pack_refuses_keys_that_overflow_int32_packing():
    with pytest.raises(KernelUnsupported, match="overflow int32 packing"):
        grouped.pack(torch.zeros(4, 3, dtype=torch.int32), 16, 2**27, 8192)


def test_group_spans_cover_the_first_to_the_last_busy_group():
    # 4 groups x 3 chunks: chunk 0 used by groups 1 and 3, chunk 1 by group 2 only, chunk 2 by none.
    bounds = torch.tensor([[0, 0, 0, 0], [0, 2, 2, 2], [1, 1, 3, 3], [0, 5, 5, 5]], dtype=torch.int32)
    assert grouped.group_spans(bounds) == [(1, 4), (2, 3), (0, 0)]


def test_query_chunks_stay_inside_a_batch_element():
    chunks = sparse_mla._query_chunks(3, 41, 16)
    assert [r for _, r0, r1 in chunks for r in range(r0, r1)] == list(range(3 * 41))  # every row once, in order
    assert all(b * 41 <= r0 < r1 <= (b + 1) * 41 and r1 - r0 <= 16 for b, r0, r1 in chunks)
    assert sparse_mla._query_chunks(3, 41, 16, last=20) == [(2, 103, 123)]
    assert sparse_mla._query_chunks(3, 41, 16, last=60) == [(1, 63, 82)]  # the trial rows: one batch element's
    assert sparse_mla._query_chunks(1, 8, 16, last=100) == [(0, 0, 8)]


def test_query_chunks_follow_the_budget():
    # 512k tokens, 16 heads, W = 2051, forward key chunks of 16k: one query chunk's packing and fp32
    # state fit 1 GiB and it is still thousands of rows (few launches per key chunk).
    n_chunks = (1 << 19) // (2 * sparse_mla.KEY_CHUNK)
    rows = grouped.rows_per_chunk(2051, 16, 512, n_chunks, 1, sparse_mla.QUERY_BUDGET_BYTES, sparse_mla.ROW_ALIGN)
    assert rows % sparse_mla.ROW_ALIGN == 0 and 8000 <= rows
    assert rows * (2051 * 32 + 16 * 514 * 4) <= sparse_mla.QUERY_BUDGET_BYTES


def test_grouped_candidates_stack_queries_into_16_rows():
    for heads, group in ((1, 16), (3, 4), (4, 4), (5, 2), (8, 2), (16, 1)):
        for kind in ("fwd_grouped", "bwd_grouped"):
            found = sparse_mla.candidates(kind, heads, 512)
            assert found and all(c.query_group == group and c.head_block * group == 16 for c in found), (heads, kind)
    for kind in ("fwd_grouped", "bwd_grouped"):
        assert all(c.query_group == 1 and c.head_block == 32 for c in sparse_mla.candidates(kind, 64, 512))


def test_bad_forward_mode_is_a_one_line_error(monkeypatch):
    args = (torch.zeros(1, 8, 4, 64), torch.zeros(1, 8, 64), torch.zeros(1, 8, 3, dtype=torch.int32))
    with pytest.raises(GenolongError, match="fwd_mode 'dense' is unknown; use one of query, keychunk, grouped"):
        sparse_mla.sparse_mla(*args, scale=0.1, fwd_mode="dense")
    monkeypatch.setenv(sparse_mla.ENV_FWD_MODE, "fast")
    monkeypatch.setattr(sparse_mla._common, "require_cuda", lambda *t: None)
    with pytest.raises(GenolongError, match="GENOLONG_SPARSE_MLA_FWD='fast' is not a mode"):
        sparse_mla.dsa_sparse_attention(*args, scale=0.1)


@needs_triton
@pytest.mark.parametrize("heads", [4, 64])  # thirteen sm_90 builds: ~15 s of CPU
def test_grouped_kernels_compile_for_sm90_without_spills(heads):
    from genolong.kernels import aot
    from genolong.kernels import sparse_mla_grouped_triton as k

    # Every candidate at 4 heads (the GPU times them all); the defaults at 64.
    take = None if heads == 4 else 1
    builds = {f"{kind} {c.label()}": k.aot_compile(kind, heads, 512, c)
              for kind in ("fwd", "bwd") for c in sparse_mla.candidates(f"{kind}_grouped", heads, 512)[:take]}
    # The key-chunked forward (fwd_mode "keychunk") runs the grouped forward kernel, one query a
    # program: all its candidates (at 64 heads the H200 chose the second, HB32/BN64/w8/s5).
    builds.update({f"fwd keychunk {c.label()}": k.aot_compile("fwd", heads, 512, c)
                   for c in sparse_mla.candidates("fwd_keychunk", heads, 512)})
    for name, kernel in builds.items():
        ptx = kernel.asm["ptx"]
        assert "mma.sync" in ptx, name  # tensor cores (16 or 32 rows: no wgmma)
        assert "cp.async" in ptx, name  # the gathered rows are copied asynchronously
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, (name, kernel.metadata.shared)
        regs, spills = aot.ptxas_usage(kernel)
        assert spills == 0, (name, regs, spills)
        if name.startswith("bwd"):
            assert "atom.global.gpu.relaxed.add.v4.f32" in ptx, name  # dkv: vectorised relaxed atomics
            assert "atom.global" not in ptx.replace("atom.global.gpu.relaxed.add.v4.f32", ""), name  # dq: no atomics
