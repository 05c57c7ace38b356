"""The fused policy runs indexer v2 for every head count (the streamed pass 1 for more heads than
the resident kernel holds, proven on the H200 on 2026-12-03); GENOLONG_INDEXER_V2_STREAMED=0 keeps
v1 for those shapes, and a bad setting is a one-line error."""

import pytest
import torch

pytest.importorskip("triton")

from genolong.kernels import indexer_topk, indexer_triton
from genolong.model.ops import KernelUnsupported


def _q(heads):
    return torch.zeros(1, 8, heads, 128, dtype=torch.bfloat16)


def test_every_head_count_runs_v2_by_default(monkeypatch):
    monkeypatch.delenv("GENOLONG_INDEXER_V2_STREAMED", raising=False)
    for heads in (4, 32):
        indexer_topk._check_v2_streamed(indexer_triton, _q(heads))


def test_streamed_shapes_fall_through_to_v1_only_when_asked(monkeypatch):
    assert not indexer_triton.q_resident(32, 128, indexer_triton.BM2) and indexer_triton.q_resident(4, 128, indexer_triton.BM2)
    monkeypatch.setenv("GENOLONG_INDEXER_V2_STREAMED", "0")
    with pytest.raises(KernelUnsupported, match="GENOLONG_INDEXER_V2_STREAMED=0: v1 runs for 32 heads"):
        indexer_topk._check_v2_streamed(indexer_triton, _q(32))
    indexer_topk._check_v2_streamed(indexer_triton, _q(4))  # resident: v2 whatever the setting


def test_a_bad_streamed_setting_is_one_line(monkeypatch):
    from genolong.errors import GenolongError

    monkeypatch.setenv("GENOLONG_INDEXER_V2_STREAMED", "yes")
    with pytest.raises(GenolongError, match="GENOLONG_INDEXER_V2_STREAMED='yes' is not 0 or 1"):
        indexer_topk._check_v2_streamed(indexer_triton, _q(4))


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
