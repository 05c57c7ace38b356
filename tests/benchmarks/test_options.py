"""Option parsing of the GPU benchmarks (they run on the H200 only; their arguments are checked here):
bench_train's environment and keep-moe arms, bench_sparse_attention's cells, bench_indexer's variants."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_env_arms_split_into_settings_per_arm():
    from bench_train import parse_env_arms

    assert parse_env_arms("") == [{}]
    assert parse_env_arms("GENOLONG_MOE_SWIGLU=eager;GENOLONG_MOE_SWIGLU=triton") == [
        {"GENOLONG_MOE_SWIGLU": "eager"}, {"GENOLONG_MOE_SWIGLU": "triton"}]
    assert parse_env_arms("A=1, B=x=y;") == [{"A": "1", "B": "x=y"}]
    with pytest.raises(SystemExit, match="'B' is not NAME=value"):
        parse_env_arms("A=1,B")


def test_keep_moe_arms_parse():
    from bench_train import parse_keep_moe

    assert parse_keep_moe("off") == [False] and parse_keep_moe("off, on") == [False, True]
    with pytest.raises(SystemExit, match="'yes' is not off or on"):
        parse_keep_moe("off,yes")
    with pytest.raises(SystemExit, match="is not off or on"):
        parse_keep_moe("")


def test_an_env_arm_does_not_inherit_the_settings_of_the_arm_before(monkeypatch):
    # Arms 'A=x,B=y;A=z' once ran the second arm with B=y still set (os.environ.update): each arm
    # must see only its own settings.
    import os

    from bench_train import use_env_arm

    monkeypatch.setenv("GL_TEST_KEEP", "base")
    monkeypatch.delenv("GL_TEST_A", raising=False)
    monkeypatch.delenv("GL_TEST_B", raising=False)
    arms = [{"GL_TEST_A": "1", "GL_TEST_B": "x", "GL_TEST_KEEP": "arm"}, {"GL_TEST_A": "2"}]
    base = dict(os.environ)
    use_env_arm(arms[0], arms, base)
    assert (os.environ["GL_TEST_A"], os.environ["GL_TEST_B"], os.environ["GL_TEST_KEEP"]) == ("1", "x", "arm")
    use_env_arm(arms[1], arms, base)
    assert os.environ["GL_TEST_A"] == "2" and "GL_TEST_B" not in os.environ and os.environ["GL_TEST_KEEP"] == "base"


def test_sparse_attention_cells_are_checked_against_the_known_implementations():
    pytest.importorskip("triton")
    from bench_sparse_attention import IMPLS, PARTS

    assert IMPLS == ("triton", "megatron", "sdpa") and set(PARTS) == {"triton-fwd", "triton-bwd", "megatron-fwd"}


def test_indexer_variants_parse():
    pytest.importorskip("triton")
    from bench_indexer import parse_variant

    assert parse_variant("v1:8") == ("v1", 8, False)
    assert parse_variant("v1:8:sorted") == ("v1", 8, True)
    assert parse_variant("v2:4") == ("v2", 4, False)
    for bad in ("v2:4:sorted", "v1:8:narrow", "v3:4", "v2:x", "v2:4:narrow8", "v1:8:sorted:8"):
        with pytest.raises(SystemExit, match="is not v1:<G>"):
            parse_variant(bad)
