"""Sharded construction and loading: each rank reads only its own slices of a transformers checkpoint.

GLM-5.3-Flash's 313B parameters are ~626 GB in bf16: no rank can build the whole model and copy
its part out (what `from_pretrained` + the parallel passes would do). Instead:

1. the model is built on the meta device (no storage; `build_meta`);
2. every pass runs on it (tp / ep slice meta tensors, FSDP shards them, genolong.train.passes);
3. `materialise` allocates this rank's tensors only (`to_empty`: its tp / ep part, of that its
   FSDP chunk);
4. `load_pretrained_sharded` runs genolong.model.checkpoint.load_weights with `ShardedTargets`:
   for each tensor on disk it lists the boxes of that tensor this rank holds and reads each with
   safe_open's `get_slice` (only those bytes; an FP8 box is widened to whole scale tiles, its
   scales read for those tiles only, dequantized and cropped). Names, coverage and shapes are
   checked against the whole model's shapes as in a single-process load.

Per-rank peak host memory is then its shard plus the largest box being read (tested: a checkpoint
larger than the address space each rank may allocate loads at fsdp=2, tests/parallel/test_sharded_load.py).

Which elements a rank holds, per dimension of a parameter (`local_index`, runs of global indices:
no per-element index is ever built): the whole range, cut by the tp / ep split of
genolong.parallel.tensor_plan (its part of each block, e.g. the conv's [q; k; v] thirds), then by
the FSDP chunk of dim 0 (torch.distributed.tensor's own offsets). Disk tensors
that fill part of a fused parameter (an expert's gate / up / down, one of the three convs) map
into it with a fixed index (the expert) and offsets (the up half, the conv third).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from genolong.errors import GenolongError
from genolong.parallel.tensor_plan import placement, split_size


def build_meta(config, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device with the dtype policy of a loaded one (fp32-kept parameters stay fp32)."""
    from genolong.model.model import GenoLongForCausalLM

    with torch.device("meta"):
        model = GenoLongForCausalLM(config, init=False)
    persistent = set(model.state_dict().keys())
    volatile = [name for name, _ in model.named_buffers() if name not in persistent]
    if volatile:
        raise GenolongError(f"the model has non-persistent buffers ({volatile[:3]}) that a load would leave uninitialised; build it on a device")
    return model.to_dtype(dtype)


def materialise(model: nn.Module, device: str | torch.device) -> None:
    """Allocate (uninitialised) storage for what this rank holds of a meta model, after its passes."""
    model.to_empty(device=device)


def local_index(key: str, full_shape: tuple, param: torch.Tensor, pmesh) -> list[list[tuple[int, int]]]:
    """Per dimension of parameter `key` (whole shape `full_shape`), the global indices this rank
    holds, in the order of its local tensor, as runs (first global index, length) (module docstring)."""
    index = [[(0, n)] for n in full_shape]
    split = placement(key)
    if pmesh is not None and split is not None and split_size(split, pmesh.layout) > 1:
        rank, size = pmesh.rank(split.group), pmesh.size(split.group)
        block = full_shape[split.dim] // split.blocks
        part = block // size
        if block * split.blocks != full_shape[split.dim] or part * size != block:
            raise GenolongError(f"{key}: dim {split.dim} of {tuple(full_shape)} does not split into {split.blocks} block(s) x {size} ranks")
        index[split.dim] = [(b * block + rank * part, part) for b in range(split.blocks)]
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        index = [_narrow(runs, o, s) for runs, s, o in zip(index, shape, offset, strict=True)]
    return index


def _narrow(runs: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The runs of local positions [start, start + length) of `runs`."""
    out, position = [], 0
    for first, n in runs:
        lo, hi = max(start, position), min(start + length, position + n)
        if lo < hi:
            out.append((first + lo - position, hi - lo))
        position += n
    return out


# The most one read asks for (fp32 bytes): a rank's box of a large tensor (an embedding chunk) is
# read in runs of rows of at most this size, so the transient copy stays small next to the shard.
READ_BYTES = 64 << 20


class ShardedTargets:
    """genolong.model.checkpoint's load targets for one rank of a parallel model (module docstring)."""

    def __init__(self, model: nn.Module, pmesh, read_bytes: int = READ_BYTES) -> None:
        self.pmesh = pmesh
        self.read_bytes = read_bytes
        self.local = dict(model.state_dict(keep_vars=True))
        whole = build_meta(model.config, torch.float32)
        self.full = dict(whole.state_dict(keep_vars=True))
        if self.full.keys() != self.local.keys():
            raise GenolongError("the parallel model's state-dict keys differ from the plain model's; a pass renamed a tensor")
        self._index: dict[str, list[list[tuple[int, int]]]] = {}  # the current target's runs

    def pieces(self, target: str, part: tuple | None, disk_shape: tuple) -> list[tuple[tuple, torch.Tensor]]:
        full_shape = tuple(self.full[target].shape)
        if target not in self._index:
            self._index = {target: local_index(target, full_shape, self.local[target], self.pmesh)}
        index = self._index[target]
        fixed, mapping = _part_mapping(part, full_shape, len(disk_shape))
        local = self.local[target]
        local = local.to_local() if isinstance(local, DTensor) else local
        prefix = []
        for dim, value in fixed:
            found = [dst for src, dst, _ in _overlaps(index[dim], value, 1)]
            if not found:
                return []
            prefix.append(found[0])
        runs_per_dim = []
        for j, (dim, offset) in enumerate(mapping):
            runs = _overlaps(index[dim], offset, disk_shape[j])
            if not runs:
                return []
            runs_per_dim.append(runs)
        row_bytes = 4 * max(1, _prod(n for _, _, n in (max(runs, key=lambda r: r[2]) for runs in runs_per_dim[1:])))
        runs_per_dim[0] = _cut(runs_per_dim[0], max(1, self.read_bytes // row_bytes))
        out = []
        for box in itertools.product(*runs_per_dim):
            region = tuple((src, src + n) for src, _, n in box)
            view = local[(*prefix, *(slice(dst, dst + n) for _, dst, n in box))]
            out.append((region, view))
        return out


def _part_mapping(part: tuple | None, full_shape: tuple, disk_dims: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(fixed (param dim, index) pairs, (param dim, offset) per disk dim) of a disk tensor filling `part`
    (genolong.model.checkpoint.Placement.part) of a parameter of whole shape `full_shape`."""
    if part is None:
        return [], [(d, 0) for d in range(disk_dims)]
    kind, index = part
    if kind == "conv":
        return [], [(0, index * (full_shape[0] // 3))] + [(d, 0) for d in range(1, disk_dims)]
    # Experts: the disk tensor is expert `index`'s [rows, cols]; "up" is the second half of gate_up's rows.
    rows = full_shape[1] // 2 if kind == "up" else 0
    return [(0, index)], [(1, rows)] + [(d, 0) for d in range(2, disk_dims + 1)]


def _overlaps(runs: list[tuple[int, int]], offset: int, length: int) -> list[tuple[int, int, int]]:
    """(index in the disk tensor, local position, length) of where `runs` (global index runs in local
    order) meet the disk tensor's span [offset, offset + length) of that dimension."""
    out, position = [], 0
    for first, n in runs:
        lo, hi = max(first, offset), min(first + n, offset + length)
        if lo < hi:
            out.append((lo - offset, position + lo - first, hi - lo))
        position += n
    return out


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _cut(runs: list[tuple[int, int, int]], rows: int) -> list[tuple[int, int, int]]:
    """The runs cut into pieces of at most `rows`."""
    return [(src + a, dst + a, min(rows, n - a)) for src, dst, n in runs for a in range(0, n, rows)]


def load_pretrained_sharded(model: nn.Module, path, pmesh, read_bytes: int = READ_BYTES):
    """Fill a materialised parallel model with its slices of the transformers checkpoint at `path`
    (config.json + safetensors, one file or sharded with an index; bf16 / fp32 / block-FP8).
    Returns genolong.model.checkpoint's LoadReport. Every rank calls it; no collective."""
    from pathlib import Path

    from genolong.model.checkpoint import load_weights, read_config

    path = Path(path)
    raw = read_config(path)
    report = load_weights(model, path, raw, targets=ShardedTargets(model, pmesh, read_bytes))
    model.hf_source_config = raw
    tokenizer = path / "tokenizer.json"
    model.hf_source_tokenizer = tokenizer.read_text(encoding="utf-8") if tokenizer.is_file() else None
    return report
