"""The one-pass integer kernels over the indexer's selection on a CUDA GPU (skipped without one):
the key-chunked backward's row bounds (sparse_mla/chunk_bounds.py) and the kept selection's pack check
and expansion (indexer/kept_selection.py), each equal to its PyTorch form on the fused indexer's
selection of 64k tokens (W = 2,051) and on rows that do not ascend or do not pack."""

import pytest
import torch

import genolong.kernels as kernels
from genolong.kernels.sparse_mla import chunk_bounds as chunk_bounds_triton
from genolong.kernels.sparse_mla import op as sparse_mla
from genolong.model import kept_selection
from tests.gpu.test_kernels import _impl, _indexer_inputs

pytestmark = pytest.mark.gpu
DEV = "cuda"
KW = dict(kpool=4, topk_pools=512, always_select_tail=True, softmax_scale=128**-0.5)


@pytest.fixture(scope="module")
def selection():
    kernels.load()
    torch.manual_seed(0)
    q, keys, w = _indexer_inputs(65536)
    return _impl("dsa_indexer_topk", "triton_fused_select")(q, keys, w, **KW)[0].contiguous()


def _torch_bounds(idx, edges):
    """The PyTorch passes: the suffix-minimum ranges even for rows that do not ascend, and whether they do."""
    bounds, ascends = sparse_mla.ascending_bounds_reference(idx, edges)
    return bounds, bool(ascends)


@pytest.mark.parametrize("key_chunk", [16384, 4096])
def test_row_bounds_equal_the_pytorch_passes(selection, key_chunk):
    edges = torch.arange(0, selection.shape[0] + key_chunk, key_chunk, dtype=torch.int32, device=DEV)
    bounds, ascends = chunk_bounds_triton.ascending_bounds(selection, edges)
    want, want_ascends = _torch_bounds(selection, edges)
    assert want_ascends and bool(ascends) and torch.equal(bounds, want)
    broken = selection.clone()
    broken[60000, 0], broken[60000, 1] = broken[60000, 1].item(), broken[60000, 0].item()  # a late row (all 512 pools valid) out of order
    bounds, ascends = chunk_bounds_triton.ascending_bounds(broken, edges)
    want, want_ascends = _torch_bounds(broken, edges)
    assert not want_ascends and not bool(ascends) and torch.equal(bounds, want)


def test_kept_selection_passes_equal_the_pytorch_passes(selection, monkeypatch):
    from genolong.kernels.indexer import kept_selection as kept_selection_triton

    monkeypatch.setenv(kept_selection_triton.ENV, "triton")  # (the default; set against a stray setting)
    idx = selection.view(1, *selection.shape)
    got = kept_selection.pack_selection(idx, kpool=4, topk_pools=512)
    fused = dict(kept_selection.FUSED)
    assert fused  # installed by kernels.load()
    kept_selection.FUSED.clear()
    try:
        want = kept_selection.pack_selection(idx, kpool=4, topk_pools=512)
        back_want = kept_selection.unpack_selection(want, kpool=4)
    finally:
        kept_selection.FUSED.update(fused)
    assert len(got) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(kept_selection.unpack_selection(got, kpool=4), back_want) and torch.equal(back_want, idx)
    shuffled = idx.clone()
    shuffled[0, 60000, :4] = shuffled[0, 60000, :4].flip(-1)  # a late row: its first group is a real pool
    assert len(kept_selection.pack_selection(shuffled, kpool=4, topk_pools=512)) == 1  # does not pack: kept whole
