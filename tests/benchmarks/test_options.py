"""Option parsing of the GPU benchmarks (they run on a GPU; their arguments are checked here):
bench_train's environment and keep-moe arms and bench_sparse_attention's backward probe names."""

import pytest


def test_env_arms_split_into_settings_per_arm():
    from benchmarks.bench_train import parse_env_arms

    assert parse_env_arms("") == [{}]
    assert parse_env_arms("GENOLONG_MOE_SWIGLU=eager;GENOLONG_MOE_SWIGLU=triton") == [
        {"GENOLONG_MOE_SWIGLU": "eager"}, {"GENOLONG_MOE_SWIGLU": "triton"}]
    assert parse_env_arms("A=1, B=x=y;") == [{"A": "1", "B": "x=y"}]
    with pytest.raises(SystemExit, match="'B' is not NAME=value"):
        parse_env_arms("A=1,B")


def test_keep_moe_arms_parse():
    from benchmarks.bench_train import parse_keep_moe

    assert parse_keep_moe("off") == [False] and parse_keep_moe("off, on") == [False, True]
    with pytest.raises(SystemExit, match="'yes' is not off or on"):
        parse_keep_moe("off,yes")
    with pytest.raises(SystemExit, match="is not off or on"):
        parse_keep_moe("")


def test_an_env_arm_does_not_inherit_the_settings_of_the_arm_before(monkeypatch):
    # Arms 'SWIGLU=eager,SORT=always;SWIGLU=triton' once ran the second arm with
    # SORT=always still set (os.environ.update): each arm must see only its own settings.
    import os

    from benchmarks.bench_train import use_env_arm

    monkeypatch.setenv("GL_TEST_KEEP", "base")
    monkeypatch.delenv("GL_TEST_A", raising=False)
    monkeypatch.delenv("GL_TEST_B", raising=False)
    arms = [{"GL_TEST_A": "1", "GL_TEST_B": "x", "GL_TEST_KEEP": "arm"}, {"GL_TEST_A": "2"}]
    base = dict(os.environ)
    use_env_arm(arms[0], arms, base)
    assert (os.environ["GL_TEST_A"], os.environ["GL_TEST_B"], os.environ["GL_TEST_KEEP"]) == ("1", "x", "arm")
    use_env_arm(arms[1], arms, base)
    assert os.environ["GL_TEST_A"] == "2" and "GL_TEST_B" not in os.environ and os.environ["GL_TEST_KEEP"] == "base"


def test_backward_probe_names_parse_to_mode_op_and_key_chunk():
    pytest.importorskip("triton")
    from benchmarks.bench_sparse_attention import PRESETS, is_impl, parse_probe

    from genolong.kernels.sparse_mla import KEY_CHUNK

    from genolong.kernels.sparse_mla_triton import Config

    default = Config(16, 16, 4, 5)
    assert parse_probe("probe-keychunk-bwd") == ("keychunk", "add", KEY_CHUNK, default, True, "coalesced")
    assert parse_probe("probe-atomic-bwd-nodkv") == ("atomic", "skip", KEY_CHUNK, default, True, "coalesced")
    assert parse_probe("probe-keychunk-bwd-store-kc4096-nopack") == ("keychunk", "store", 4096, default, False, "coalesced")
    assert parse_probe("probe-keychunk-bwd-cfg16x64x8x2t") == ("keychunk", "add", KEY_CHUNK, Config(16, 64, 8, 2, slot_major=True), True, "coalesced")
    assert parse_probe("probe-atomic-bwd-nodkv-cfg32x16x8x5")[3] == Config(32, 16, 8, 5)
    assert parse_probe("probe-keychunk-bwd-layout-cfg16x16x4x5k4")[3:] == (Config(16, 16, 4, 5, split_k=4), True, "layout")
    assert all(is_impl(impl) for preset in ("bwd-probe", "split-adds") for _, _, impl in PRESETS[preset]["cells"])
    for bad in ("probe-keychunk-fwd", "probe-keychunk-bwd-kc0", "probe-keychunk-bwd-fast", "probe-keychunk-bwd-cfg16x64x8",
                "probe-keychunk-bwd-cfg16x0x8x2", "probe-keychunk-bwd-cfg16x16x4x5k0", "probe-keychunk-bwd-cfg16x16x4x5kx"):
        with pytest.raises(SystemExit, match=bad):
            parse_probe(bad)


def test_key_chunked_forward_cells_name_their_key_chunk():
    pytest.importorskip("triton")
    from benchmarks.bench_sparse_attention import PRESETS, is_impl, kcfwd_chunk

    assert kcfwd_chunk("triton-kcfwd65536-fwd") == 65536 and kcfwd_chunk("triton-kcfwd-fwd") is None
    assert is_impl("triton-kcfwd16384-fwd") and is_impl("triton-kcfwd") and is_impl("triton-kcfwd-fwd")
    for bad in ("triton-kcfwd0-fwd", "triton-kcfwd16k-fwd", "triton-kcfwd16384"):
        assert kcfwd_chunk(bad) is None and not is_impl(bad), bad
    assert all(is_impl(impl) for preset in PRESETS.values() for _, _, impl in preset["cells"])


def test_pinned_forward_config_cells_parse():
    pytest.importorskip("triton")
    from benchmarks.bench_sparse_attention import forward_config, is_impl

    from genolong.kernels.sparse_mla_triton import Config

    assert forward_config("triton-cfg16x32x8x9-fwd") == Config(16, 32, 8, 9) and is_impl("triton-cfg16x64x8x7-fwd")
    assert forward_config("triton-cfg16x32x8x5k8-fwd") == Config(16, 32, 8, 5, split_k=8)
    for bad in ("triton-cfg16x32x8-fwd", "triton-cfg16x0x8x9-fwd", "triton-cfg16x32x8x9", "triton-fwd", "triton-cfg16x32x8x5t-fwd",
                "triton-cfg16x32x8x5k-fwd"):
        assert forward_config(bad) is None, bad
    assert not is_impl("triton-cfg16x32x8-fwd")


def test_every_pinned_config_of_a_preset_builds():
    """A preset cell's pinned launch config must pass the kernels' own checks (a split with fewer
    slices than warps would time each slice's product twice: refused by check_split)."""
    pytest.importorskip("triton")
    from benchmarks.bench_sparse_attention import LATENT, PRESETS, forward_config, parse_probe

    from genolong.kernels.sparse_mla_triton import check_split

    pinned = [forward_config(impl) or parse_probe(impl)[3] for preset in PRESETS.values() for _, _, impl in preset["cells"]
              if forward_config(impl) or impl.startswith("probe-") and "-bwd" in impl]
    assert any(c.split_k > 1 for c in pinned)
    for config in pinned:
        check_split(config, LATENT)


def test_indexer_variants_name_their_selection_build():
    pytest.importorskip("triton")
    from benchmarks.bench_indexer import parse_variant

    assert parse_variant("v1:8") == ("v1", 8, False, None)
    assert parse_variant("v1:8:sorted") == ("v1", 8, True, None)
    assert parse_variant("v2:4") == ("v2", 4, False, None)
    assert parse_variant("v2:4:narrow8") == ("v2", 4, False, "narrow8")
    for bad in ("v2:4:sorted", "v1:8:narrow", "v3:4", "v2:x", "v2:4:wide:8", "v2:4:fast"):
        with pytest.raises(SystemExit, match="is not v1:<G>"):
            parse_variant(bad)
