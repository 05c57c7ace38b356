"""The GPU kernels build for Hopper (sm_90) on a machine without a GPU, at the model's shapes.

Sequence lengths are run-time values in both kernels, so one build serves every length; what a
1M-token input needs from the build is 64-bit offsets, checked in the generated code.
"""

import importlib.util
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _megatron_missing() -> str | None:
    try:
        import megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_fwd as f
    except Exception as why:
        return (f"megatron-core is not importable on Python {sys.version_info.major}.{sys.version_info.minor} "
                f"({type(why).__name__}: {why}); it needs Python >= 3.12")
    return None if f.HAVE_TILELANG else "tilelang is not installed"


@needs_triton
@pytest.mark.parametrize("heads,dim", [(4, 128), (32, 128)])  # glm53-mini, GLM-5.3-Flash indexers
def test_triton_indexer_passes_compile_for_sm90(heads, dim):
    from genolong.kernels import aot, indexer_triton

    kernels = indexer_triton.aot_compile(heads, dim, kpool=4, group=8)
    group_max = kernels["group_max"].asm["ptx"]
    assert "wgmma" in group_max  # the scoring product runs on Hopper's warpgroup tensor cores
    assert ".local" not in group_max  # no register spills to local memory
    assert "mma" in kernels["candidate_scores"].asm["ptx"]
    v2 = indexer_triton.aot_compile_v2(heads, dim, kpool=4, group=8)
    group_max = v2["group_max_v2"].asm["ptx"]
    assert "wgmma" in group_max and "cp.async" in group_max  # tensor cores, key loads pipelined
    assert all(".local" not in kernel.asm["ptx"] for kernel in v2.values())
    for name, kernel in {**kernels, **v2}.items():
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, \
            f"{name} at {heads} heads needs {kernel.metadata.shared} bytes of shared memory, sm_90 has {aot.SM90_SHARED_BYTES}"


@pytest.mark.parametrize("heads", [4, pytest.param(64, marks=pytest.mark.slow)])  # glm53-mini, GLM-5.3-Flash
def test_tilelang_sparse_mla_compiles_for_sm90(heads):
    missing = _megatron_missing()
    if missing:
        pytest.skip(missing)
    from genolong.kernels import dsa_sparse_tilelang as dsa

    sources = dsa.compile_kernels(heads, topk=2051, scale=128**-0.5)
    for name, src in sources.items():
        assert "__global__" in src, name
        assert "(int64_t)seq_len" in src, f"{name}: offsets are not 64-bit; 1M-token inputs would overflow"
