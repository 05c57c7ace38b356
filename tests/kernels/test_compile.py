"""The GPU kernels build for Hopper (sm_90) on a machine without a GPU, at the model's shapes.

Sequence lengths are run-time values in both kernels, so one build serves every length; what a
1M-token input needs from the build is 64-bit offsets, checked in the generated code. The Triton
builds are specialised as the JIT specialises a launch (genolong/kernels/aot.py), so the shared
memory they report is what the H200 would ask for; the other kernels' build checks (sparse MLA,
indexer loss, Sinkhorn) sit beside their tests.
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
    from genolong.kernels import aot
    from genolong.kernels.indexer import triton_kernels as indexer_triton

    kernels = indexer_triton.aot_compile(heads, dim, kpool=4, group=8)
    group_max = kernels["group_max"].asm["ptx"]
    assert "wgmma" in group_max  # the scoring product runs on Hopper's warpgroup tensor cores
    assert ".local" not in group_max  # no register spills to local memory
    assert "mma" in kernels["candidate_scores"].asm["ptx"]
    from genolong.kernels.indexer.topk import V2_GROUP

    v2 = indexer_triton.aot_compile_v2(heads, dim, kpool=4, group=V2_GROUP)  # the group selection at 1M tokens
    group_max = v2["group_max_v2"].asm["ptx"]
    assert "wgmma" in group_max and "cp.async" in group_max  # tensor cores, loads pipelined
    assert aot.ptxas_usage(v2["group_max_v2"])[1] == 0  # no spills
    if heads == 4:
        # G * 512 candidate scores held per query: 2,048 at G = 4 fit in registers (at G = 8 ptxas spills).
        assert aot.ptxas_usage(v2["select_candidates"])[1] == 0
    for name, kernel in {**kernels, **v2}.items():
        assert ".local" not in kernel.asm["ptx"], name
        assert kernel.metadata.shared <= aot.SM90_SHARED_BYTES, \
            f"{name} at {heads} heads needs {kernel.metadata.shared} bytes of shared memory, sm_90 has {aot.SM90_SHARED_BYTES}"


@needs_triton
@pytest.mark.parametrize("heads", [4, 32])
def test_every_v2_pass1_tile_fits_sm90_shared_memory(heads):
    # The benchmark's tile sweep launches each of these on the H200: none may ask for more.
    from genolong.kernels import aot
    from genolong.kernels.indexer import triton_kernels as indexer_triton

    for tile in indexer_triton.PASS1_TILES:
        shared = indexer_triton.aot_compile_group_max_v2(heads, 128, kpool=4, group=8, tile=tile).metadata.shared
        assert shared <= aot.SM90_SHARED_BYTES, f"tile {tile} at {heads} heads needs {shared} bytes of shared memory"


@needs_triton
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_the_default_v2_pass1_fits_sm90_at_every_head_count_and_width(dim):
    # The op's own launch (the default tile, the kernel q_resident picks) at head dims it accepts:
    # at 256 wide, one or two heads' q blocks beside three key stages once asked for 233-266 KB.
    from genolong.kernels import aot
    from genolong.kernels.indexer import triton_kernels as indexer_triton

    for heads in (1, 2, 3, 4, 8, 16, 32, 64):
        shared = indexer_triton.aot_compile_group_max_v2(heads, dim, kpool=4, group=4).metadata.shared
        assert shared <= aot.SM90_SHARED_BYTES, f"{heads} heads x {dim} need {shared} bytes of shared memory"


@needs_triton
def test_build_check_specialises_like_the_jit():
    from genolong.kernels import aot
    from genolong.kernels.indexer import triton_kernels as indexer_triton
    from genolong.kernels.sparse_mla import triton_kernels as sparse_mla_triton

    # Triton's rules: pointers (torch allocations) and integers that are multiples of 16 are
    # marked divisible by 16, an integer equal to 1 becomes a constant, others are left alone.
    fn = indexer_triton._group_max_v2_kernel
    args = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", sg_ptr="*fp32", n_rows=2051, t0=4096,
                n_pools="i32", n_groups=1, n_super=3, stride_qt=512, stride_qh=128, stride_kp=128, stride_wt=4,
                stride_ot=16384, stride_st=2048)
    signature, constants, attrs = aot.specialise(fn, args)
    marked = {fn.arg_names[i] for (i,) in attrs}
    assert marked == {"q_ptr", "k_ptr", "w_ptr", "out_ptr", "sg_ptr", "t0", "n_pools", "stride_qt", "stride_qh", "stride_kp",
                      "stride_ot", "stride_st"}
    assert all(attr == [["tt.divisibility", 16]] for attr in attrs.values())
    assert constants == {"n_groups": 1} and signature["n_groups"] == "constexpr" and signature["n_rows"] == "i32"
    # do_not_specialize is honoured: sparse MLA's head count stays a plain integer at 64 heads.
    fwd = sparse_mla_triton._sparse_mla_fwd_kernel
    _, _, attrs = aot.specialise(fwd, dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32",
                                           row0=0, seq_q=4096, seq_kv=4096, width=2051, scale_log2=0.1, H=64))
    assert {fwd.arg_names[i] for (i,) in attrs} == {"q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr"}


@needs_triton
def test_specialisation_is_what_makes_the_pipelined_loads_asynchronous():
    # Built bare (no divisibility known), pass 1 v2's key loads are plain loads and the build
    # under-states shared memory; under the JIT's specialisation they become cp.async copies
    # staged in shared memory, one buffer per stage.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from genolong.kernels import aot
    from genolong.kernels.indexer import triton_kernels as indexer_triton

    bm, bn, warps, stages = indexer_triton.PASS1_TILES[0]
    kernel = indexer_triton._pass1_v2_kernel(4, 128, bm, None)
    const = dict(KPOOL=4, H=4, D=128, BM=bm, BN=bn, G=8, SG=8, N_INNER=indexer_triton.N_INNER2, STAGES=stages)
    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", sg_ptr="*fp32")
    signature = {name: "constexpr" if name in const else pointers.get(name, "i32") for name in kernel.arg_names}
    bare = triton.compile(ASTSource(kernel, signature, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    jit = indexer_triton.aot_compile_group_max_v2(4, 128, kpool=4, group=8)
    assert "cp.async" not in bare.asm["ptx"] and "cp.async" in jit.asm["ptx"]
    # At least the key block (BN x 128, bf16) of every stage but the one the bare build holds.
    assert jit.metadata.shared - bare.metadata.shared >= (stages - 1) * bn * 128 * 2
    assert aot.SM90_SHARED_BYTES == 227 * 1024


@pytest.mark.slow(seconds=20)  # each an nvcc build of the TileLang kernels
@pytest.mark.parametrize("heads", [4, 64])  # glm53-mini, GLM-5.3-Flash
def test_tilelang_sparse_mla_compiles_for_sm90(heads):
    missing = _megatron_missing()
    if missing:
        pytest.skip(missing)
    from genolong.kernels.sparse_mla import tilelang as dsa

    sources = dsa.compile_kernels(heads, topk=2051, scale=128**-0.5)
    for name, src in sources.items():
        assert "__global__" in src, name
        assert "(int64_t)seq_len" in src, f"{name}: offsets are not 64-bit; 1M-token inputs would overflow"


@needs_triton
@pytest.mark.parametrize("width, n_bounds", [(2051, 9), (2051, 65)])  # glm53-mini's W: 128k and 1M tokens of 16k-key chunks
def test_chunk_bounds_pass_compiles_for_sm90_without_spills(width, n_bounds):
    import triton

    from genolong.kernels import aot
    from genolong.kernels.sparse_mla import chunk_bounds as cb

    block = triton.next_power_of_2(width)
    kernel = aot.build(cb._chunk_bounds_kernel,
                       dict(idx_ptr="*i32", edges_ptr="*i32", bounds_ptr="*i32", flag_ptr="*i32", width="i32", n_bounds="i32"),
                       dict(BW=block, NB=triton.next_power_of_2(n_bounds)), num_warps=8)
    assert aot.ptxas_usage(kernel)[1] == 0  # no spills


@needs_triton
def test_kept_selection_passes_compile_for_sm90_without_spills():
    from genolong.kernels import aot
    from genolong.kernels.indexer import kept_selection as ks

    args = dict(width="i32", topk="i32", tail_width="i32")
    blocks = dict(KPOOL=4, TOPK_B=512, TAIL_B=4)  # glm53-mini / GLM-5.3: 512 pools of 4 and a 3-slot tail
    pack = aot.build(ks._kept_selection_pack_kernel, dict(idx_ptr="*i32", pools_ptr="*i32", tail_ptr="*i32", flag_ptr="*i32", **args), blocks, num_warps=4)
    expand = aot.build(ks._kept_selection_expand_kernel, dict(pools_ptr="*i32", tail_ptr="*i32", out_ptr="*i32", **args), blocks, num_warps=4)
    assert aot.ptxas_usage(pack)[1] == 0 and aot.ptxas_usage(expand)[1] == 0  # no spills
