"""The Triton sparse-MLA op replayed from its kept (out, lse) (genolong.train.keep), in Triton's
interpreter: the replay returns the kept values and gives the kernels' own gradients, equal to
those after a fresh forward, and to the plain-PyTorch replay (genolong.model.sparse_replay)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.kernels.test_sparse_mla_triton import INTERPRETER_PATCH

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_INTERPRETED = INTERPRETER_PATCH + r"""
import json
import torch

from genolong.kernels.sparse_mla import op as sparse_mla
from genolong.model.sparse_replay import sparse_attention_replay_reference

g = torch.Generator().manual_seed(5)
batch, seq, kv_len, heads, dim, width = 2, 24, 40, 4, 32, 13
q = torch.randn(batch, seq, heads, dim, generator=g)
kv = torch.randn(batch, kv_len, dim, generator=g)
idx = torch.randint(-1, kv_len, (batch, seq, width), generator=g, dtype=torch.int32)
idx[1, 7] = -1
dout = torch.randn(q.shape, generator=g)

def grads(fn):
    a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = fn(a, b)
    out.backward(dout)
    return out.detach(), lse, a.grad, b.grad

fresh = grads(lambda a, b: sparse_mla.sparse_mla(a, b, idx, scale=0.2, return_lse=True))
with torch.no_grad():
    kept = sparse_mla.sparse_mla(q, kv, idx, scale=0.2, return_lse=True)
replayed = grads(lambda a, b: sparse_mla.replay_dsa_sparse_attention(kept, a, b, idx, scale=0.2, return_lse=True))
reference = grads(lambda a, b: sparse_attention_replay_reference(kept, a.double(), b.double(), idx, scale=0.2, return_lse=True))

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()

print("RESULT", json.dumps(dict(
    out_is_kept=bool(torch.equal(replayed[0], kept[0])), lse_is_kept=bool(torch.equal(replayed[1], kept[1])),
    dq_vs_fresh=rel(replayed[2], fresh[2]), dkv_vs_fresh=rel(replayed[3], fresh[3]),
    dq_vs_reference=rel(replayed[2], reference[2]), dkv_vs_reference=rel(replayed[3], reference[3]),
    dkv_norm=float(replayed[3].norm()))))
"""


@needs_triton
@pytest.mark.slow  # ~10 s of interpreter
def test_the_replay_gives_the_kernels_gradients_from_the_kept_result():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads(lines[-1][7:])
    assert r["out_is_kept"] and r["lse_is_kept"], r
    assert r["dkv_norm"] > 0, r
    # The same backward kernels on the same inputs: equal up to the order of fp32 atomic adds.
    assert r["dq_vs_fresh"] < 1e-6 and r["dkv_vs_fresh"] < 1e-6, r
    assert r["dq_vs_reference"] < 1e-5 and r["dkv_vs_reference"] < 1e-5, r
