"""The device / dtype / kernel-policy rule shared by eval-positional and eval-recall."""

import pytest
import torch

from genolong.errors import GenolongError
from genolong.eval import runtime


def test_cpu_defaults_and_canonical_names():
    cpu = torch.device("cpu")
    assert runtime.pick_dtype_and_kernels(cpu, None, None) == ("float32", "reference")
    assert runtime.pick_dtype_and_kernels(cpu, "bf16", "reference") == ("bfloat16", "reference")
    assert runtime.DTYPES[runtime.pick_dtype_and_kernels(cpu, "fp32", None)[0]] is torch.float32


@pytest.mark.parametrize(("dtype", "kernels", "words"), [("float16", None, "--dtype must be"), (None, "fast", "--kernels must be one of")])
def test_bad_choices_are_refused_in_one_line(dtype, kernels, words):
    with pytest.raises(GenolongError, match=words) as err:
        runtime.pick_dtype_and_kernels(torch.device("cpu"), dtype, kernels)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(GenolongError, match="use --device cpu"):
        runtime.pick_device("cuda")


def test_settle_gives_one_runtime_for_both_commands():
    rt = runtime.settle(torch.device("cpu"), "fp32", None, runtime.loss_chunk_tokens("2k"))
    assert (rt.dtype, rt.policy, rt.chunk_tokens, rt.torch_dtype) == ("float32", "reference", 2048, torch.float32)
    assert runtime.loss_chunk_tokens(None) is None


@pytest.mark.parametrize(("bootstrap", "fraction", "words"), [(0, 0.1, "--bootstrap must be at least 1"), (10, 1.0, "--max-n-fraction must be in")])
def test_common_sampling_options_are_refused_in_one_line(bootstrap, fraction, words):
    with pytest.raises(GenolongError, match=words) as err:
        runtime.check_sampling(bootstrap, fraction)
    assert "\n" not in str(err.value)
