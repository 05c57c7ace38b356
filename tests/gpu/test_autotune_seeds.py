"""The shipped autotuning choices cover a glm53-mini step on this GPU (needs CUDA).

A fresh process with an empty Triton cache (a fresh machine) runs a 4-layer glm53-mini forward
and backward at 8k tokens on the fused kernels; every autotuned kernel must find its choice in
genolong/kernels/autotuned/ and so time no candidate. Fails when the seeds were recorded with
other package versions than this install's, or miss a kernel the model now launches:
re-record them (benchmarks/device/autotune_seeds.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

STEP = r"""
import json, torch
from triton.runtime import autotuner
timed = []
original = autotuner.Autotuner._bench
def counting(self, *args, **kwargs):
    timed.append(self.base_fn.__name__)
    return original(self, *args, **kwargs)
autotuner.Autotuner._bench = counting
import genolong.kernels
from genolong.model.model import GenoLongForCausalLM, bind_kernel_policy
from genolong.model.presets import get_preset
genolong.kernels.load()
model = GenoLongForCausalLM(get_preset("glm53-mini", num_layers=4)).cuda().to_dtype(torch.bfloat16)
bind_kernel_policy(model, "fused")
ids = torch.randint(0, 4, (1, 8192), device="cuda")
model(ids).logits.float().square().mean().backward()
torch.cuda.synchronize()
print("TIMED " + json.dumps(sorted(set(timed))))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fresh_cache_times_no_candidate(tmp_path):
    from genolong.kernels import autotune_seeds

    if not list(autotune_seeds.SEEDS.glob("*.json")):
        pytest.fail("no autotuning choices shipped in genolong/kernels/autotuned/")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    timed = json.loads(done.stdout.split("TIMED ", 1)[1])
    assert timed == [], f"kernels autotuned despite the shipped choices: {timed}"
