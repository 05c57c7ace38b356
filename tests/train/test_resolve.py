"""The run resolved once (genolong.train.resolve): what the spec holds, and that a run builds its
model config, checks its layout and plans its memory once per process."""

import dataclasses
from collections import Counter

import pytest
import torch

import genolong.model
from genolong.errors import GenolongError
from genolong.train import distributed, loop, preflight
from genolong.train.resolve import resolve
from tests.train._helpers import tiny_options

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_spec_holds_device_dtype_kernels_layout_and_config(data, tmp_path):
    spec = resolve(tiny_options(data, tmp_path / "run", seq_len=64, indexer_topk=8))
    assert (spec.device, spec.dtype, spec.kernels) == ("cpu", torch.float32, "reference")
    assert spec.layout.is_single and spec.resume_from is None and spec.plan is None
    assert spec.config.name == "tiny" and spec.config.dsa.indexer.topk == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.device = "cuda"
    planned = spec.planned()
    assert planned.plan is not None and planned.plan.fits and planned.plan.device == "cpu"
    assert planned.on_device("cpu") == planned and spec.plan is None


def test_bad_input_is_refused_while_resolving(data, tmp_path):
    with pytest.raises(GenolongError, match="dtype must be bfloat16 or float32"):
        resolve(tiny_options(data, tmp_path / "run", seq_len=64, dtype="float16"))
    with pytest.raises(GenolongError, match="not a multiple of the indexer's pool size"):
        resolve(tiny_options(data, tmp_path / "run", seq_len=64, indexer_topk=7))


@pytest.fixture
def calls(monkeypatch):
    seen = Counter()

    def counting(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            seen[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    counting(genolong.model, "get_preset")
    counting(distributed, "check_processes")
    counting(preflight, "preflight_cpu")
    return seen


def test_a_worker_resolves_its_run_once(data, tmp_path, calls):
    loop.train(tiny_options(data, tmp_path / "run", steps=1, seq_len=64))
    assert calls == {"get_preset": 1, "check_processes": 1, "preflight_cpu": 1}


def test_a_torchrun_rank_reuses_the_launchers_resolution(data, tmp_path, calls):
    options = tiny_options(data, tmp_path / "run", steps=1, seq_len=64)
    spec = loop.check_inputs(options)  # what launch() does before it trains in the same process
    loop.train(options, spec)
    assert calls == {"get_preset": 1, "check_processes": 1, "preflight_cpu": 1}
