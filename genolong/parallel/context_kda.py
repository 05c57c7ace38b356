"""KDA under context parallelism: state passing ("state") or a Ulysses head split ("ulysses").

Which one runs: `kda_mode` of apply_context_parallel; its default "auto" takes Ulysses where the
KDA heads divide by cp (measured faster, docs/parallel.md), state passing elsewhere.

**State passing.** Rank r holds tokens [r T/cp, (r+1) T/cp) with all heads.
- The short conv (kernel W) at a shard's first W-1 tokens reads the previous shard's last W-1
  pre-conv channels: they come from the previous rank (`from_previous_rank`), their gradient goes
  back. Op "kda_short_conv_cp".
- The recurrence is affine in its initial state: with S the state before the shard,
  S_end = M S + S_ext and o_t = o_ext,t + (q_t^T P_t) S, where P_t is the product of the per-token
  transitions up to t and M = P_end. The KDA op itself computes all of it in one call if v is
  widened by Dk zero columns and started from the state [0 | I]: the first Dv columns of its output
  and final state are o_ext and S_ext (the zero-start run), the last Dk columns q_t^T P_t and M.
  Ranks all-gather (S_ext, M) (fp32, [B, H, Dk, Dv + Dk] per rank, with autograd), each chains the
  ones before it in fp32, S_r = M_{r-1} S_{r-1} + S_ext,{r-1}, and adds (q^T P) S_r to its output.
  Gradients reach
  every rank's q, k, v, g, beta through autograd (the gather's backward is a reduce-scatter).
  Op "kda_cp"; its reference is this, through the "kda" op's contract, so on the GPU it runs
  fla's chunk kernel; the fused implementation is fla's own CP (genolong/parallel/context_kda_fla.py).
- Communication per layer: (S_ext, M) per rank and head, 0.25 MiB per head at Dk = Dv = 128 in
  fp32, independent of the length; compute: the recurrence with Dv + Dk value columns instead of Dv.

**Ulysses.** Each rank all-gathers the layer's input hidden states [B, T/cp, hidden] -> [B, T,
hidden] (the small pre-projection tensor, not the projected q/k/v/gates: the original recipe's context parallelism),
runs the module's projections, conv, recurrence and gated norm for its H/cp heads over the
whole sequence (a functional call on head slices of the weights, the same split as tensor
parallelism's: genolong.parallel.tensor_plan), and o_proj on those heads' columns; the partial
[B, T, hidden] outputs are summed and scattered back to sequence shards. Gradients: each rank
produces only its heads' slices of the head-split weights and its share of the shared ones
(f_a_proj, g_a_proj, o_norm); the "grad" group's sum assembles the single-process gradient.
Communication per layer: T x hidden gathered and T x hidden reduce-scattered, and their adjoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.func import functional_call

from genolong.model import ops
from genolong.model.kda import KimiDeltaAttention
from genolong.parallel.collectives import from_previous_rank, gather_along, scatter_sum_along
from genolong.parallel import context_kda_fla
from genolong.parallel.context_group import ContextGroup
from genolong.parallel.tensor_plan import local_part, placement


class ContextParallelKDA(KimiDeltaAttention):
    """KDA on a sequence shard, by state passing or by a Ulysses head split (module docstring)."""

    cp: ContextGroup
    kda_mode: str

    def forward(self, x: torch.Tensor, *, plain: bool = False) -> torch.Tensor:
        if plain:  # the single-device layer: the Ulysses path calls it on head slices of the weights
            return super().forward(x)
        if self.kda_mode == "ulysses":
            return ulysses_forward(self, x, self.cp)
        return state_passing_forward(self, x, self.cp)

    def extra_repr(self) -> str:
        how = "state passing" if self.kda_mode == "state" else "Ulysses head split"
        return f"{self.cp}, {how}"


def state_passing_forward(module: KimiDeltaAttention, x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    layer = module.layer_idx
    qkv = ops.call("kda_short_conv_cp", layer, module.qkv_projections(x), module.conv1d.weight.squeeze(1),
                   group=cp.group, layer=layer)
    q, k, v, g, beta = module.recurrence_inputs(x, qkv)
    o = ops.call("kda_cp", layer, q, k, v, g, beta, group=cp.group, layer=layer)
    return module.output(x, o)


def ulysses_forward(module: KimiDeltaAttention, x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    whole = gather_along(x, 1, cp.group)
    heads = {}
    for name, param in module.named_parameters():
        split = placement(name)
        if split is not None:
            heads[name] = local_part(param, split, cp.rank, cp.size)
    partial = functional_call(module, heads, (whole,), {"plain": True}, strict=False)
    return scatter_sum_along(partial, 1, cp.group)


# ------------------------------------------------------------------ the ops and their references


def short_conv_cp_reference(x: torch.Tensor, weight: torch.Tensor, *, group, layer: int = -1) -> torch.Tensor:
    """The "kda_short_conv_cp" op: the "kda_short_conv" op (docs/ops.md) of a sequence shard
    x [B, T/cp, C] as part of the whole sequence: the previous rank's last W-1 tokens precede it
    (zeros before rank 0's first token, as the single-device conv)."""
    halo = weight.shape[-1] - 1
    if halo == 0:
        return ops.call("kda_short_conv", layer, x, weight)
    if x.shape[1] < halo:
        raise ValueError(f"a context shard of {x.shape[1]} tokens is shorter than the short conv's halo of {halo}")
    before = from_previous_rank(x[:, -halo:], group)
    return ops.call("kda_short_conv", layer, torch.cat([before, x], dim=1), weight)[:, halo:]


def kda_cp_reference(q, k, v, g, beta, *, group, layer: int = -1) -> torch.Tensor:
    """The "kda_cp" op: the "kda" op (docs/ops.md) of a sequence shard [B, T/cp, H, D] as part of the
    whole sequence, by state passing (module docstring). Returns o [B, T/cp, H, Dv] in q's dtype.

    Every rank runs the same graph (rank 0 too, whose carried-in state is zero): collectives in
    backward must run on all ranks in the same order, and a rank whose output did not depend on
    the gathered summaries would skip the gather's backward and leave the others waiting.
    Rounding: o_ext and q^T P leave the op in q's dtype, the sum is taken in fp32 and rounded once."""
    rank = dist.get_rank(group)
    batch, _, heads, dk = k.shape
    dv = v.shape[-1]
    wide_v = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)
    eye = torch.eye(dk, dtype=torch.float32, device=q.device).expand(batch, heads, dk, dk)
    start = torch.cat([eye.new_zeros(batch, heads, dk, dv), eye], dim=-1)
    wide_o, final = ops.call("kda", layer, q, k, wide_v, g, beta, initial_state=start, output_final_state=True)
    o, o_from_start = wide_o.split([dv, dk], dim=-1)
    # [cp, B, H, Dk, Dv + Dk]: (S_ext | M) of every rank, in the state's precision (fp32, or float64).
    summaries = gather_along(final.unsqueeze(0), 0, group)
    # The chain starts from zeros that depend on the summaries (rank 0 keeps them), so that every
    # rank's output depends on the gather (see the docstring).
    state = summaries[0, ..., :dv] * 0.0
    for summary in summaries[:rank]:
        s_ext, transition = summary.split([dv, dk], dim=-1)
        state = torch.matmul(transition, state) + s_ext
    carried = torch.einsum("bthk,bhkv->bthv", o_from_start.to(state.dtype), state)
    return (o.to(state.dtype) + carried).to(q.dtype)


ops.register("kda_short_conv_cp", ops.REFERENCE, short_conv_cp_reference)
ops.register("kda_cp", ops.REFERENCE, kda_cp_reference)
# The fused implementations of these two ops exist only for context parallelism, so they are
# registered here rather than by genolong.kernels.load(); they import fla when called and decline
# (KernelUnsupported) what they cannot run, so the kernel policy treats them like any other.
ops.register("kda_short_conv_cp", "fla_cp_causal_conv1d", context_kda_fla.short_conv_cp_fla)
ops.register("kda_cp", "fla_cp_chunk_kda", context_kda_fla.kda_cp_fla)
