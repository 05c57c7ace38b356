"""The MoE's output kept from the forward for the layer's recompute (MemoryOptions.keep_moe, opt-in).

Under full recompute plus the MoE's chunk checkpoint (genolong.train.memory.ChunkedMoE) every MoE
forward ran three times a step: in the forward, in the layer's recompute (without saving: the chunks
are checkpointed), and chunk by chunk once more in backward (saving, for the MoE's own backward).
The second run only rebuilds the output that the rest of the layer's recompute reads. With the
output kept (genolong.train.keep's replay frame, next to the DSA results) the recompute takes it
instead, and the MoE runs twice: in the forward, and with autograd inside its own backward.

Both passes of the layer return the output through the same autograd node, `_RunAgainInBackward`,
which saves only the MoE's input: the layer's (non-reentrant) checkpoint requires its recompute to
save what its forward saved. The node's backward runs the MoE chunk by chunk with autograd (one
chunk's activations alive at a time, as under the chunk checkpoint) and returns the gradients of
the input and of the MoE's parameters (the module's at forward time: the passes set them once,
before training); it runs under the kernel policy the forward ran under.
What it costs: the output, hidden x 2 bytes a token for each MoE layer, parked in the offload's
pinned pool (0.125 GiB a MoE layer at 128k for glm53-mini), and two layers' of it on the GPU at
once (the layer being recomputed and the next one's, prefetched), as for the DSA results.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from genolong.model import frames, ops

KEPT_OP = "moe_output"  # the name the replay frame records it under (genolong.train.keep)


def moe_layer_index(moe: torch.nn.Module) -> int:
    """The layer a MoE module belongs to (its experts' hot op is audited under it)."""
    return moe.experts.layer_idx


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def run_in_chunks(moe: torch.nn.Module, x: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The MoE over x's flattened tokens, `chunk_tokens` at a time (its steps are per token)."""
    flat = x.reshape(-1, x.shape[-1])
    return torch.cat([moe(flat[a:b]) for a, b in chunks(flat.shape[0], chunk_tokens)]).view_as(x)


class _RunAgainInBackward(torch.autograd.Function):
    """Returns `produce()` (the MoE's output, run in the forward or kept); its backward runs the MoE
    again with autograd, chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx, produce, moe, chunk_tokens, again, x, *params):
        ctx.moe, ctx.chunk_tokens, ctx.again, ctx.params = moe, chunk_tokens, again, params
        ctx.save_for_backward(x)
        return produce()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[4]
        wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[5 + i]]
        flat, flat_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(ctx.params)
        with torch.enable_grad(), ctx.again:
            for a, b in chunks(flat.shape[0], ctx.chunk_tokens):
                piece = flat[a:b].detach().requires_grad_(wants_x)
                out = ctx.moe(piece)
                inputs = ([piece] if wants_x else []) + [ctx.params[i] for i in wanted]
                got = list(torch.autograd.grad(out, inputs, flat_grad[a:b], allow_unused=True))
                if wants_x:
                    dx[a:b] = got.pop(0)
                for i, g in zip(wanted, got):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
                del out, piece, got
        return (None, None, None, None, dx.view_as(x) if wants_x else None, *sums)


def kept_moe_output(moe: torch.nn.Module, x: torch.Tensor, chunk_tokens: int, frame) -> torch.Tensor:
    """The MoE's output inside a replay frame that keeps KEPT_OP: run and recorded in the layer's
    forward, taken from the frame in its recompute; either way it leaves through the same node
    (module docstring)."""
    layer_idx = moe_layer_index(moe)
    params = tuple(p for p in moe.parameters() if p.requires_grad)
    kept = frame.replay(KEPT_OP, layer_idx, (x,))[1] if frame.replaying else None
    if kept is not None:
        out = kept[0]
    else:
        # With autograd, as the chunks' checkpoints ran it, so the MoE's hooks see the step's forward
        # (the expert balancer counts loads and builds its balance loss there), but nothing it saves
        # is kept: not even handed to the layer checkpoint, whose recompute must save what its forward
        # saved, and which in the recompute sees only this node's save of x. The graph is dropped at once.
        # (outside the frame: the recompute does not run this MoE, so nothing of it, the router's choice
        # included, may be recorded for the recompute to find)
        with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped), frames.replay_frame(None):
            out = run_in_chunks(moe, x, chunk_tokens).detach()
    _, again = ops.recompute_context()  # the policy in force now, for the run in backward
    result = _RunAgainInBackward.apply(lambda: out, moe, chunk_tokens, again, x, *params)
    if not frame.replaying:
        frame.record(KEPT_OP, layer_idx, "chunked", (x,), (out,))
    return result


def _drop(_tensor: torch.Tensor) -> None:
    return None


def _dropped(_packed) -> torch.Tensor:
    raise RuntimeError("genolong.train.keep_moe: the forward run's graph of a kept MoE output has no saved tensors; "
                       "its gradient comes from the node that runs the MoE again in backward")
