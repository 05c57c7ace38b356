"""Sharded construction and loading (genolong.parallel.sharded_load) on gloo.

A transformers glm5_next checkpoint (several safetensors shards with an index; FP8 block-scaled
projections) loads into a model built on the meta device and parallelised at fsdp=2 x tp=2: every
rank's slices, gathered, equal one process's `from_pretrained`. And at fsdp=2 each rank's peak
anonymous memory during the load (RssAnon, sampled after every read, when the read box and the
shard both exist) stays below 55% of the checkpoint's size: it reads only its half. (The file's
memory-mapped pages are page cache, not the process's own; RLIMIT_DATA cannot bound the load
because safetensors maps the file private and writable.)
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from genolong.model import GenoLongForCausalLM, fp8, get_preset
from genolong.model.checkpoint import INDEX_FILE, from_pretrained, save_pretrained
from tests.parallel.harness import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = (16, 8)  # scale tiles smaller than the tensors, so rank boundaries fall inside tiles


def _fp8_checkpoint(src: Path, dst: Path) -> None:
    """`src` rewritten with every 2-D projection weight in e4m3 with a float32 scale grid, in 4 shards."""
    index = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        with safe_open(src / shard, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    for key in [k for k, t in tensors.items() if t.dim() == 2 and k.endswith("proj.weight")]:
        tensors[key], tensors[fp8.scale_key(key)] = fp8.quantize(tensors[key], BLOCK)
    dst.mkdir()
    keys = sorted(tensors)
    weight_map = {}
    for i in range(4):
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        part = keys[i::4]
        save_file({k: tensors[k].contiguous() for k in part}, dst / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(raw))


def _build_and_load(layout: str, path: str, dtype: torch.dtype, read_bytes: int):
    from genolong.model import checkpoint
    from genolong.model.checkpoint import read_config
    from genolong.model.hf_config import from_hf
    from genolong.parallel.layout import parse_layout
    from genolong.parallel.mesh import build_mesh
    from genolong.parallel.sharded_load import build_meta, load_pretrained_sharded, materialise
    from genolong.train.options import MemoryOptions, TrainOptions
    from genolong.train.passes import parallelize

    pmesh = build_mesh(parse_layout(layout), "cpu")
    model = build_meta(from_hf(read_config(path)), dtype)
    parallelize(model, TrainOptions(memory=MemoryOptions(offload=False), compile=False), pmesh)
    before = _status("RssAnon")
    peak = [before]
    read = checkpoint._read

    def sampled(*args):
        out = read(*args)
        peak.append(_status("RssAnon"))
        return out

    checkpoint._read = sampled
    try:
        materialise(model, "cpu")
        load_pretrained_sharded(model, path, pmesh, read_bytes=read_bytes)
    finally:
        checkpoint._read = read
    return model, pmesh, max(peak) - before


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _gathered(rank, world, path):
    from genolong.parallel.tensor_state import full_state_dict

    model, pmesh, _ = _build_and_load("fsdp=2,tp=2", path, torch.float32, 4096)
    held = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in model.state_dict().values())
    return {k: v.detach().numpy() for k, v in full_state_dict(model.state_dict(), pmesh).items()}, held


@pytest.mark.slow  # four gloo processes: ~30 s on the shared 2-core machine
def test_fsdp2_tp2_ranks_read_their_slices_of_a_sharded_fp8_checkpoint(tmp_path):
    torch.manual_seed(0)
    save_pretrained(GenoLongForCausalLM(get_preset("tiny")), tmp_path / "bf", max_shard_bytes=200_000)
    _fp8_checkpoint(tmp_path / "bf", tmp_path / "fp8")
    reference = from_pretrained(tmp_path / "fp8", dtype=torch.float32).state_dict()
    ranks = run_ranks(_gathered, 4, str(tmp_path / "fp8"), timeout=600)
    whole = sum(t.numel() for t in reference.values())
    for full, held in ranks:
        assert full.keys() == reference.keys()
        for key, tensor in reference.items():
            assert torch.equal(torch.from_numpy(full[key]), tensor), key
        assert held < 0.4 * whole  # fsdp halves every tensor, tp the split ones again


def _load_and_measure(rank, world, path):
    model, _, grown = _build_and_load("fsdp=2", path, torch.bfloat16, 1 << 20)
    sums = {k: float(t.to_local().double().sum()) if hasattr(t, "to_local") else float(t.double().sum()) / world
            for k, t in model.state_dict().items()}
    held = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in model.state_dict().values())
    return sums, held, grown


def test_a_checkpoint_larger_than_each_ranks_allocation_loads_at_fsdp2(tmp_path):
    torch.manual_seed(0)
    # A large vocabulary makes the embedding and lm_head most of the model: 2 x 320k x 64 in bf16, ~80 MiB
    # (large enough that the process's own allocation noise, a few MiB, does not decide the bound).
    model = GenoLongForCausalLM(get_preset("tiny", vocab_size=320_000), dtype=torch.bfloat16)
    save_pretrained(model, tmp_path / "big", max_shard_bytes=8 << 20)
    size = sum(p.stat().st_size for p in (tmp_path / "big").glob("*.safetensors"))
    budget = int(0.55 * size)  # a rank must read only its half (and little besides)
    ranks = run_ranks(_load_and_measure, 2, str(tmp_path / "big"), timeout=600)
    reference = from_pretrained(tmp_path / "big", dtype=torch.bfloat16).state_dict()
    for key, tensor in reference.items():
        assert abs(sum(r[0][key] for r in ranks) - float(tensor.double().sum())) <= 1e-6 * float(tensor.double().abs().sum()) + 1e-9, key
    for _, held, grown in ranks:
        assert held < 0.55 * size and grown < budget
    print(f"checkpoint {size / 2**20:.1f} MiB; per rank: held {[r[1] / 2**20 for r in ranks]} MiB, "
          f"peak anonymous memory grew {[r[2] / 2**20 for r in ranks]} MiB during the load (budget {budget / 2**20:.1f} MiB)")
