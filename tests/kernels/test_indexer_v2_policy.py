"""The fused policy runs indexer v2 only where its pass-1 kernel is proven on the GPU (the
resident kernel); with more heads it falls through to v1 unless asked for v2 explicitly."""

import pytest
import torch

pytest.importorskip("triton")

from genolong.kernels import indexer_topk, indexer_triton
from genolong.model.ops import KernelUnsupported


def _q(heads):
    return torch.zeros(1, 8, heads, 128, dtype=torch.bfloat16)


def test_few_heads_pass_the_proven_check(monkeypatch):
    monkeypatch.delenv("GENOLONG_INDEXER_V2_STREAMED", raising=False)
    indexer_topk._check_v2_proven(indexer_triton, _q(4))


def test_many_heads_fall_through_unless_forced(monkeypatch):
    monkeypatch.delenv("GENOLONG_INDEXER_V2_STREAMED", raising=False)
    with pytest.raises(KernelUnsupported, match="GENOLONG_INDEXER_V2_STREAMED=1"):
        indexer_topk._check_v2_proven(indexer_triton, _q(32))
    monkeypatch.setenv("GENOLONG_INDEXER_V2_STREAMED", "1")
    indexer_topk._check_v2_proven(indexer_triton, _q(32))
