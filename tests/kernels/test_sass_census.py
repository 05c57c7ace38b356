"""benchmarks/sass_census.py reads the sm_90 SASS of the sparse-MLA kernels (CPU: Triton's ahead-of-time
build and the nvdisasm Triton ships). Checked against what the products' shapes require."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_census_of_the_packed_backward_counts_its_products_and_adds():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this triton has no nvdisasm")
    from sass_census import census, sass, slot_loop

    from genolong.kernels import sparse_mla_triton as k

    config = k.Config(16, 16, 4, 5)
    found = {}
    for red in (False, True):
        kernel = k.aot_compile("bwd", 4, 512, config, ranged=True, red=red)
        found[red] = census(slot_loop(sass(kernel)), config.num_warps)
    # A 16-slot block of the packed backward: x = qd K^T (16 x 16, K 512: 2 n8 tiles x 32 k16 steps),
    # dq += dS K and dkv = [dS; P]^T qd (16 x 512, K 16: 64 tiles each), the shift products (16 x 16 x 16):
    # at least 64 + 64 + 64 + 2 + 2 m16n8k16 steps, more where warps repeat tiles.
    assert found[False]["hmma"] >= 196 and found[False]["hmma"] == found[True]["hmma"]
    # The dkv block (16 rows x 512 fp32) is added once a block, as vector reductions, with either kind of adds.
    assert found[False]["red"] == found[True]["red"] == 16 * 512 * 4
    assert found[False]["red_scalar"] == 0  # tl.atomic_add: vector atomics only
    # The layout adds skip the block's trip through shared memory.
    assert found[True]["smem_wr"] <= found[False]["smem_wr"] - 16 * 512 * 4 // 2
