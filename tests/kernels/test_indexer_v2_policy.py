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


def test_v2_runs_its_own_group_size_and_a_bad_setting_is_one_line(monkeypatch):
    from genolong.errors import GenolongError

    seen = []
    monkeypatch.setattr(indexer_topk, "_check", lambda *a: None)  # CUDA-only check; the call itself is captured
    monkeypatch.setattr(indexer_topk, "indexer_fused_select", lambda *a, group, **kw: seen.append(group))
    args = (_q(4), torch.zeros(1, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 4))
    kw = dict(kpool=4, topk_pools=2, always_select_tail=True, softmax_scale=1.0)
    monkeypatch.delenv(indexer_topk.ENV_V2_GROUP, raising=False)
    indexer_topk.dsa_indexer_topk_fused_select(*args, **kw)
    monkeypatch.setenv(indexer_topk.ENV_V2_GROUP, "8")
    indexer_topk.dsa_indexer_topk_fused_select(*args, **kw)
    assert seen == [indexer_topk.V2_GROUP, 8] and indexer_topk.V2_GROUP == 4
    monkeypatch.setenv(indexer_topk.ENV_V2_GROUP, "6")
    with pytest.raises(GenolongError, match="GENOLONG_INDEXER_V2_GROUP='6' is not a power of two"):
        indexer_topk.dsa_indexer_topk_fused_select(*args, **kw)
