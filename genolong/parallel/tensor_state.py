"""State dicts of a tp / ep model: DTensor views for torch.distributed.checkpoint, full tensors, loading.

Each rank's parameters are plain tensors holding its part (genolong.parallel.tensor_plan), so
the model's own code runs unchanged. For checkpoints, `sharded_state_dict` wraps every part in
a DTensor *view* (no copy) with the part's placement on the "tp" or "ep" mesh dimension: DCP
then writes each element once with its global shape and offset, and loads at any other layout
(tp=2 -> 1 process, 1 process -> tp=2 x ep=2, ...). Keys are the plain model's.

The one exception is the KDA short conv (`conv1d.weight`): it convolves the concatenated
[q; k; v] channels and a rank keeps its heads' part of *each* third, which no single Shard
placement describes; its view is the full tensor, all-gathered (it is 3 x qkv x 4 numbers per
layer), and `restore_from_sharded` copies this rank's part back after a load.

Usage (model and an optimizer's flat state alike; keys are matched on their tail):

    views = sharded_state_dict(model.state_dict(), pmesh)
    dcp.save(views, checkpoint_id=...)                    # any layout
    views = sharded_state_dict(model.state_dict(), pmesh)
    dcp.load(views, checkpoint_id=...)                    # saved at any layout
    restore_from_sharded(model.state_dict(), views, pmesh)

Under FSDP (genolong.parallel.fsdp) a tensor is a DTensor holding this rank's chunk (dim 0, over
the "shard" group) of its tp / ep part; its view puts both on one 2-D mesh in the root mesh's
order: ("ep", "shard") with Shard(0) twice (ep outer: chunks of each ep part), or ("shard", "tp")
where, when the tp split is along dim 0 too, the chunks of each tp part are
`_StridedShard(0, split_factor=tp)` (the layout FSDP2 itself gives FSDP over TP).

`full_tensors` yields whole tensors one at a time (an export to a single-process checkpoint;
every rank must iterate all of them: each is a collective); `load_full_state` copies this
rank's parts out of whole tensors (a single-process or pretrained checkpoint into a tp/ep model).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from genolong.errors import GenolongError
from genolong.parallel.fsdp import chunk_of
from genolong.parallel.tensor_plan import Split, assemble, local_part, placement, split_size


def _split_of(key: str, value, pmesh) -> Split | None:
    split = placement(key)
    if not isinstance(value, torch.Tensor) or split_size(split, pmesh.layout) == 1:
        return None
    return split


def _gather(part: torch.Tensor, split: Split, pmesh) -> torch.Tensor:
    parts = [torch.empty_like(part) for _ in range(pmesh.size(split.group))]
    dist.all_gather(parts, part.contiguous(), group=pmesh.group(split.group))
    return assemble(parts, split)


def sharded_state_dict(state: Mapping[str, object], pmesh) -> dict[str, object]:
    """DCP's view of `state` (module docstring). Collective (the conv gathers)."""
    out: dict[str, object] = {}
    for key, value in state.items():
        split = _split_of(key, value, pmesh)
        if isinstance(value, DTensor):
            out[key] = _fsdp_view(value, split, pmesh)
        elif split is None:
            out[key] = value
        elif split.blocks == 1:
            out[key] = DTensor.from_local(value, pmesh.mesh[split.group], [Shard(split.dim)], run_check=False)
        else:
            out[key] = _gather(value, split, pmesh)
    return out


def _fsdp_view(value: DTensor, split: Split | None, pmesh):
    """DCP's view of an FSDP chunk of a tp / ep part (module docstring)."""
    if split is None:
        return value
    if split.blocks > 1:
        return _gather(value.full_tensor(), split, pmesh)
    size = pmesh.size(split.group)
    shape = list(value.shape)
    shape[split.dim] *= size
    stride = torch.empty(shape, device="meta").stride()
    if split.group == "ep":  # before the shard dimensions in the mesh
        mesh, placements = pmesh.mesh["ep", "shard"], [Shard(split.dim), Shard(0)]
    else:
        inner = _StridedShard(0, split_factor=size) if split.dim == 0 else Shard(0)
        mesh, placements = pmesh.mesh["shard", split.group], [inner, Shard(split.dim)]
    return DTensor.from_local(value.to_local(), mesh, placements, shape=torch.Size(shape), stride=stride, run_check=False)


@torch.no_grad()
def restore_from_sharded(state: Mapping[str, object], views: Mapping[str, object], pmesh) -> None:
    """After `dcp.load(views)`: copy into `state`'s tensors every entry that did not load in place."""
    for key, target in state.items():
        if not isinstance(target, torch.Tensor):
            continue
        value = views[key]
        if isinstance(value, DTensor):
            value = value.to_local()
        split = _split_of(key, target, pmesh)
        if split is not None and split.blocks > 1:
            value = local_part(value, split, pmesh.rank(split.group), pmesh.size(split.group))
            if isinstance(target, DTensor):
                value = chunk_of(value, target)
        if isinstance(target, DTensor):
            target = target.to_local()
        if value.data_ptr() != target.data_ptr():
            target.copy_(value)


def full_tensors(state: Mapping[str, object], pmesh) -> Iterator[tuple[str, object]]:
    """(key, whole tensor) for every entry of `state`, one gathered at a time. Collective per split tensor."""
    for key, value in state.items():
        split = _split_of(key, value, pmesh)
        if isinstance(value, DTensor):
            value = value.full_tensor()
        yield key, value if split is None else _gather(value, split, pmesh)


def full_state_dict(state: Mapping[str, object], pmesh) -> dict[str, object]:
    """Every entry whole (small models and tests; large ones iterate `full_tensors`)."""
    return dict(full_tensors(state, pmesh))


@torch.no_grad()
def load_full_state(state: Mapping[str, object], full: Mapping[str, torch.Tensor], pmesh) -> None:
    """Copy this rank's part of each whole tensor in `full` into `state`'s tensors (same keys)."""
    missing = [key for key, value in state.items() if isinstance(value, torch.Tensor) and key not in full]
    if missing:
        raise GenolongError(f"the full state dict lacks {len(missing)} of the model's entries, e.g. {missing[:3]}; load a checkpoint of this model")
    for key, target in state.items():
        if not isinstance(target, torch.Tensor):
            continue
        split = _split_of(key, target, pmesh)
        source = full[key]
        if split is not None:
            source = local_part(source, split, pmesh.rank(split.group), pmesh.size(split.group))
        if isinstance(target, DTensor):
            source, target = chunk_of(source, target), target.to_local()
        target.copy_(source)
