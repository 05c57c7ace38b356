"""Sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) over the mesh's fsdp x cp ranks.

`apply_fsdp(model, pmesh)` shards every parameter of a built (and tp / ep sliced, cp wrapped,
recompute / offload wrapped) model over the "shard" group, the fsdp ranks times the cp ranks
(tensor_plan.SHARD_DIMS: cp ranks hold the same weights and sum their gradients, so they shard
them too, as torchtitan's dp_shard x cp; at cp=1 it is the fsdp ranks): each decoder layer is one FSDP group (its
parameters are all-gathered before its forward, freed after it, gathered again for its backward
or its recompute, and its gradients reduce-scattered), and the root group holds the embedding,
the final norm and lm_head (gathered once per forward and kept until backward ends: the loop
reads `lm_head.weight` outside the model's forward for its chunked loss). `hidden_states` is
registered as a forward method so that it unshards the root like `forward`. A model on the meta
device is sharded as it is; `to_empty` then allocates each rank's chunks only
(genolong.parallel.sharded_load).

What each rank holds: dim 0 of its tp / ep part of every parameter cut in fsdp x cp chunks
(torch.chunk: the last chunks may be shorter or empty), as a DTensor on the "shard" mesh; the
optimizer (genolong.train.optim.MasterAdamW) keeps masters and moments of that chunk only.

Gradients: FSDP reduce-scatters with a divide factor of 1 (a sum: each rank's loss is already
divided by the step's global token count, docs/parallel.md) in fp32 (MixedPrecisionPolicy's
reduce_dtype: one rounding of a bf16 gradient, as GradientSync's fp32 buckets). The rest of a
parameter's sum (over dp, ep, tp as tensor_plan.grad_reduce_group says, less fsdp and cp) is
GradientSync's, on the local chunks ("*_shard" groups of tensor_plan).

Parameters of another dtype than the model's (the fp32-kept router, conv, gate and mHC scalars of
a bf16 model: genolong.model.model.FP32_PARAM_SUFFIXES) are left out of FSDP (`ignored_params`):
FSDP2 needs one dtype per group, and they are small (the router's E x hidden is the largest);
they stay replicated and GradientSync sums them over their whole group.

A training DSA indexer's parameters are left out the same way (`replicated`, from
genolong.train.passes): its KL gradient does not come from the backward FSDP hooks. The dense
warm-up accumulates it during a forward under no_grad, into the gathered parameters that the
layer's post-forward then frees, and no post-backward (reduce-scatter) ever runs for them: the
gradient was lost and the sharded one stayed None (measured at fsdp=2: an empty warm-up
gradient; left there, it was added into the next step's reduce-scatter). Replicated, the
gradient lands on the registered parameter itself and GradientSync sums it over its whole group.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from genolong.errors import GenolongError
from genolong.parallel.tensor_plan import ensure_shard_reduce_groups


def apply_fsdp(model: nn.Module, pmesh, *, replicated: set[nn.Parameter] = frozenset()) -> list[nn.Module]:
    """Shard `model` over pmesh's "fsdp" dimension (module docstring); returns the FSDP groups' modules.
    `replicated`: parameters left out of FSDP besides the odd-dtype ones (a training indexer's,
    whose gradient FSDP's backward hooks never see). Collective (the extra gradient groups); every
    rank calls it. fsdp=1 does nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if pmesh.layout.fsdp == 1:
        return []
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise GenolongError("apply_fsdp: the model is already sharded; apply it once, to a model with plain parameters")
    ensure_shard_reduce_groups(pmesh)
    mesh = pmesh.mesh["shard"]
    ignored = odd_dtype_parameters(model) | set(replicated)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    groups = []
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True, ignored_params=ignored)
        groups.append(layer)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    groups.append(model)
    if hasattr(model, "hidden_states"):
        register_fsdp_forward_method(model, "hidden_states")
    for module in groups:
        module.set_gradient_divide_factor(1.0)
        # A plain SUM (gloo has no PREMUL_SUM; a factor of 1 needs no scaling anyway).
        module.set_force_sum_reduction_for_comms(True)
    return groups


def odd_dtype_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters whose dtype is not the most common one (module docstring: left out of FSDP)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        return set()
    dtypes = Counter()
    for p in params:
        dtypes[p.dtype] += p.numel()
    common = dtypes.most_common(1)[0][0]
    return {p for p in params if p.dtype != common}


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise GenolongError("apply_fsdp expects a GenoLongForCausalLM / GenoLongModel (with .layers)")
    return list(layers)


def is_sharded(tensor) -> bool:
    """True for an FSDP-sharded parameter, gradient or optimizer state (a DTensor)."""
    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of an FSDP-sharded tensor (a view, no copy); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(value: torch.Tensor, param) -> torch.Tensor:
    """`value` (this rank's chunk, shaped as param's) as a DTensor laid out as the sharded `param`;
    `value` itself when `param` is not sharded."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False)


def chunk_of(whole: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """The rows of `whole` (shaped as sharded's global shape) that this rank holds of `sharded`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(sharded.shape, sharded.device_mesh, sharded.placements)
    out = whole
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        if size != whole.shape[dim]:
            out = out.narrow(dim, start, size)
    return out
