"""Where every parameter lives under tensor (tp) and expert (ep) parallelism, and which ranks sum its gradient.

One table, read by name, decides it all: `apply_tensor_parallel` / `apply_expert_parallel`
slice parameters by it, the checkpoint views (genolong.parallel.tensor_state) and the gradient
sync (genolong.parallel.tensor_grads) read the same table. Names are matched on their tail, so a
prefix (`model.`, an optimizer's `master.`, a wrapper's segment above the owning module) does
not matter.

Split over tp (this rank keeps its heads' / columns' part):
- KDA: q/k/v_proj, forget_gate.f_b_proj, b_proj, g_b_proj rows and forget_gate.dt_bias /
  A_log per head; conv1d channels per head *within each of its three blocks* (the conv runs over
  the concatenated [q; k; v] channels, so a rank keeps [q_r; k_r; v_r], not a contiguous third);
  o_proj columns.
- DSA: q_b_proj and kv_b_proj rows (per head), o_proj columns.
- Dense MLP and the MoE's shared expert: gate_proj / up_proj rows, down_proj columns.
Split over ep: the routed experts' gate_up_proj / down_proj along the expert dimension.
Everything else is replicated (norms, mHC, the latent projections of DSA and the low-rank KDA
gates, the indexer, the router, embedding, lm_head).

Gradient groups (sums; each rank's loss is already divided by the global token count; dp
below stands for dp x fsdp):
| parameter                         | summed over        | group name    |
|-----------------------------------|--------------------|---------------|
| split over tp                     | dp x ep x cp       | "grad"        |
| lm_head (after the final gather every tp rank computes the same full gradient) | dp x ep x cp | "grad" |
| split over ep (routed experts)    | dp x cp x tp       | "grad_expert" |
| every other (replicated) one      | dp x ep x cp x tp  | "grad_sp"     |

Under FSDP (genolong.parallel.fsdp, sharding over SHARD_DIMS = fsdp x cp) that part of the sum is
FSDP's reduce-scatter, and the rest runs on each rank's chunk over the same dimensions less fsdp
and cp ("grad_shard", ...).

Under sequence parallelism the tp ranks of a replicated parameter each see their own sequence
shard (or, inside a mixer, only their heads' share of the gradient), so their parts add up over
tp; the experts are different parameters on different ep ranks, so ep is left out of theirs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from genolong.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Split:
    """`dim` of the parameter is split evenly over the `group` ranks ("tp" or "ep"), rank r keeping
    the r-th part of each of `blocks` equal consecutive blocks of that dim."""

    group: str
    dim: int
    blocks: int = 1


_TAIL = r"(?:^|\.)"
_RULES: tuple[tuple[re.Pattern, Split], ...] = tuple(
    (re.compile(_TAIL + pattern + "$"), split)
    for pattern, split in (
        (r"(?:q_proj|k_proj|v_proj|b_proj|g_b_proj|f_b_proj|q_b_proj|kv_b_proj)\.weight", Split("tp", 0)),
        (r"forget_gate\.(?:dt_bias|A_log)", Split("tp", 0)),
        (r"conv1d\.weight", Split("tp", 0, blocks=3)),
        (r"o_proj\.weight", Split("tp", 1)),
        (r"(?:gate_proj|up_proj)\.weight", Split("tp", 0)),
        (r"down_proj\.weight", Split("tp", 1)),
        (r"experts\.(?:gate_up_proj|down_proj)", Split("ep", 0)),
    )
)
_FULL_GRADIENT_ON_EVERY_TP_RANK = re.compile(_TAIL + r"lm_head\.weight$")

# Flattened groups of the mesh (genolong.parallel.mesh): name -> mesh dimensions.
REDUCE_GROUPS = {
    "grad": ("dp", "ep", "fsdp", "cp"),
    "grad_sp": ("dp", "ep", "fsdp", "cp", "tp"),
    "grad_expert": ("dp", "fsdp", "cp", "tp"),
}
# FSDP shards over these (flattened: the "shard" group): the fsdp ranks and the cp ranks, which
# hold the same weights (torchtitan's dp_shard x cp).
SHARD_DIMS = ("fsdp", "cp")
# The sums less SHARD_DIMS: what is left after FSDP's reduce-scatter (each rank its own chunk).
SHARD_REDUCE_GROUPS = {f"{name}_shard": tuple(d for d in dims if d not in SHARD_DIMS) for name, dims in REDUCE_GROUPS.items()}


def placement(name: str) -> Split | None:
    """How the tensor named `name` (a parameter, buffer, or a state keyed by one) is split; None: replicated."""
    for pattern, split in _RULES:
        if pattern.search(name):
            return split
    return None


def split_size(split: Split | None, layout: ParallelLayout) -> int:
    return 1 if split is None else getattr(layout, split.group)


def local_part(full: torch.Tensor, split: Split, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of `full` (a view when blocks == 1, else a new tensor)."""
    if full.shape[split.dim] % (split.blocks * size):
        raise ValueError(
            f"dim {split.dim} of a {tuple(full.shape)} tensor does not split into {split.blocks} block(s) x {size} ranks"
        )
    blocks = full.chunk(split.blocks, dim=split.dim)
    parts = [block.chunk(size, dim=split.dim)[rank] for block in blocks]
    return parts[0] if split.blocks == 1 else torch.cat(parts, dim=split.dim)


def assemble(parts: list[torch.Tensor], split: Split) -> torch.Tensor:
    """The full tensor from every rank's part, in rank order (the inverse of `local_part`)."""
    if split.blocks == 1:
        return torch.cat(parts, dim=split.dim)
    per_rank = [p.chunk(split.blocks, dim=split.dim) for p in parts]
    return torch.cat([per_rank[r][b] for b in range(split.blocks) for r in range(len(parts))], dim=split.dim)


def shard_group(name: str, layout: ParallelLayout) -> str | None:
    """The mesh dimension this tensor is split over ("tp" / "ep"), None when every rank holds all of it."""
    split = placement(name)
    return split.group if split_size(split, layout) > 1 else None


def grad_reduce_group(name: str, layout: ParallelLayout, *, sharded: bool = False) -> str | None:
    """The flattened mesh group over which the gradient of parameter `name` is summed (module docstring).

    Returns "grad" whenever the group has the same ranks as "grad", so a layout without tp and
    ep needs no extra groups. sharded: the parameter is FSDP-sharded, its fsdp sum already done:
    the group less SHARD_DIMS, None when that leaves a single rank."""
    split = placement(name)
    if split is not None and split.group == "ep":
        group = "grad_expert"
    elif split is not None or _FULL_GRADIENT_ON_EVERY_TP_RANK.search(name):
        group = "grad"
    else:
        group = "grad_sp"
    if sharded:
        dims = SHARD_REDUCE_GROUPS[f"{group}_shard"]
        return canonical_group(dims, layout) if _ranks_of(dims, layout) else None
    return canonical_group(REDUCE_GROUPS[group], layout)


def canonical_group(dims: tuple[str, ...], layout: ParallelLayout) -> str:
    """The first name of REDUCE_GROUPS (then SHARD_REDUCE_GROUPS) with the same ranks as the mesh dimensions `dims`."""
    for group, group_dims in (*REDUCE_GROUPS.items(), *SHARD_REDUCE_GROUPS.items()):
        if _ranks_of(group_dims, layout) == _ranks_of(dims, layout):
            return group
    raise ValueError(f"no flattened group spans the dimensions {dims} of layout {layout}")


def _ranks_of(dims: tuple[str, ...], layout: ParallelLayout) -> frozenset[str]:
    """The dimensions that actually have more than one rank: two groups over the same ones are the same group."""
    return frozenset(d for d in dims if getattr(layout, d) > 1)


def ensure_reduce_groups(pmesh) -> None:
    """Create the flattened groups "grad_sp" and "grad_expert" on `pmesh` (collective: call on every rank)."""
    for group, dims in REDUCE_GROUPS.items():
        if group != "grad":
            pmesh.mesh[dims]._flatten(group)


def ensure_shard_reduce_groups(pmesh) -> None:
    """Create FSDP's "shard" group and every group its chunks are summed over after its
    reduce-scatter (collective)."""
    ensure_reduce_groups(pmesh)
    pmesh.mesh[SHARD_DIMS]._flatten("shard")
    for group, dims in SHARD_REDUCE_GROUPS.items():
        pmesh.mesh[dims]._flatten(group)


def slice_parameters(model: torch.nn.Module, group: str, rank: int, size: int) -> list[str]:
    """Keep only this rank's part of every parameter the table splits over `group`; returns their names.

    The parameters stay the same objects (an optimizer built afterwards sees the parts) and the
    full tensors are released; shape attributes of the owning Linear / Conv1d follow, so that
    print(model) shows what each rank holds."""
    sliced = []
    for name, param in model.named_parameters():
        split = placement(name)
        if split is None or split.group != group:
            continue
        part = local_part(param.data, split, rank, size)
        param.data = part.clone(memory_format=torch.contiguous_format)
        sliced.append(name)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif isinstance(module, torch.nn.Conv1d):
            module.in_channels = module.out_channels = module.groups = module.weight.shape[0]
    return sliced
