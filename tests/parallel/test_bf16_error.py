"""The bf16 comparison rule itself: passes a second draw of the same rounding, fails added error."""

import numpy as np
import pytest

from tests.parallel.bf16_error import assert_bf16_error_no_worse


def _grads(rng, noise: dict[str, float]) -> tuple[dict, dict, dict]:
    shapes = {"big.weight": (64, 64), "hc.scale": (3,), "hc.base": (24,), "norm.weight": (64,)}
    ref32 = {k: rng.standard_normal(s) for k, s in shapes.items()}
    draw = lambda scale: {k: v + scale.get(k, 1e-2) * rng.standard_normal(v.shape) * np.abs(v).mean() for k, v in ref32.items()}  # noqa: E731
    return draw(noise), draw({}), ref32


def test_a_second_draw_of_bf16_rounding_passes():
    rng = np.random.default_rng(0)
    for _ in range(20):
        got, ref16, ref32 = _grads(rng, {})
        assert_bf16_error_no_worse(got, ref16, ref32)


@pytest.mark.parametrize("name", ["big.weight", "hc.scale"])
def test_ten_times_the_error_in_one_tensor_fails(name):
    # A small tensor's 10x error is diluted in the group's RMS, so the group must still notice it:
    # 3 elements at 10x out of 4 small tensors raise the group's RMS ~5x.
    got, ref16, ref32 = _grads(np.random.default_rng(1), {name: 1e-1})
    with pytest.raises(AssertionError):
        assert_bf16_error_no_worse(got, ref16, ref32)
