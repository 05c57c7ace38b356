"""`parallelize(model, options, pmesh)`: every pass over a built model, in one fixed order.

The model (genolong/model) is plain single-device PyTorch. What a training run changes about it is
applied here, from outside, as in torchtitan's `parallelize()`; each pass wraps or switches
modules so that print(model) shows it, and none changes a state-dict key or a parameter name:

1. kernel policy     `bind_kernel_policy`: the model's own genolong.model.ops.KernelPolicy (GenoLongModel.kernel_policy)
2. tensor / expert   genolong.parallel.tensor.apply_tensor_parallel, genolong.parallel.expert.apply_expert_parallel
   parallel          (slice parameters, so before the optimizer exists; the plain modules switched to
                     their TensorParallel* / ExpertParallel* subclasses)
3. context parallel  genolong.parallel.context.apply_context_parallel (the sequence mixers)
4. MoE chunking      ChunkedMoE(MoE); the mHC fp32-input ablation Fp32InputMHC(HyperConnection)
5. recompute,        Recompute(DecoderLayer), Offload(Recompute(...)) (genolong.train.memory); with --tile,
   offload           Tiled(DecoderLayer) (genolong.train.tiling: the layer in checkpointed sequence tiles)
6. compile           Compiled* subclasses of the small-op modules (genolong.train.compile)
7. fsdp              genolong.parallel.fsdp.apply_fsdp: FSDP2 (fully_shard) per decoder layer and the root
8. gradient sync     genolong.parallel.grad_sync.GradientSync over the mesh's gradient groups

Why this order: the parallel passes replace modules' math and slice parameters, so every pass
that wraps a module must see their modules (MoE chunks run through the expert-parallel
dispatch, recompute replays the context-parallel exchange); chunking sits inside a layer, so
before the layer wrappers; offload hooks must enclose the recompute's checkpoint; compile
switches the small modules last, where nothing replaces them again; FSDP shards the parameters the
module passes left (tp / ep parts) and hooks the outermost wrapper of each layer, so its gathers
enclose the recompute and the offload (as torchtitan: TP, AC, compile, then FSDP); the gradient
sync needs the final (sharded) parameters. A single process (pmesh None) gets passes 1 and 4-6: today's one-GPU run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from genolong.errors import GenolongError
from genolong.model import ops
from genolong.model.model import bind_kernel_policy

PASS_ORDER = ("kernel policy", "tensor/expert parallel", "context parallel", "MoE chunking", "recompute + offload", "compile", "fsdp", "gradient sync")


@dataclass
class Parallelized:
    """What `parallelize` did: the handles the loop reads (memory statistics, compile counters,
    the gradient sync) and `remove()` for the wrappers that can be undone."""

    model: torch.nn.Module
    policy: ops.KernelPolicy
    memory: object
    compiled: object | None = None
    grads: object | None = None
    pmesh: object | None = None

    def remove(self) -> None:
        """Unwrap the memory passes and switch compiled modules back (frees the host offload pool)."""
        if self.compiled is not None:
            self.compiled.remove()
        self.memory.remove()


def parallelize(model: torch.nn.Module, options, pmesh=None, *, kernels: str = ops.REFERENCE) -> Parallelized:
    """Apply every pass (module docstring) to `model` for the run `options` (a TrainOptions: its
    `memory` and `compile`) on `pmesh` (a genolong.parallel.mesh.ParallelMesh or None)."""
    from genolong.train.memory import apply_memory_optimizations

    if kernels != ops.REFERENCE:
        import genolong.kernels

        genolong.kernels.load()
    policy = bind_kernel_policy(model, kernels)
    if pmesh is not None:
        layout = pmesh.layout
        if layout.tp > 1:
            _parallel_pass("tensor", "apply_tensor_parallel", f"tp={layout.tp}")(model, pmesh)
        if layout.ep > 1:
            _parallel_pass("expert", "apply_expert_parallel", f"ep={layout.ep}")(model, pmesh)
        if layout.cp > 1:
            _parallel_pass("context", "apply_context_parallel", f"cp={layout.cp}")(model, pmesh)
    memory = apply_memory_optimizations(model, options.memory)
    compiled = None
    on_gpu = next(model.parameters()).device.type == "cuda"
    if compile_pass_on(options.compile, on_gpu, kernels):
        from genolong.train.compile import apply_compile

        # On the GPU the hot-op policy runs mHC as its fused Triton passes (7-9x the eager mHC);
        # compiling it would replace them, so the pass compiles the norms, router and MLP only.
        compiled = apply_compile(model, mhc=not on_gpu or kernels == ops.REFERENCE)
    grads = None
    if pmesh is not None and pmesh.layout.fsdp > 1:
        from genolong.train.indexer import is_indexer_parameter

        # A training indexer's gradient arrives outside FSDP's backward hooks (genolong.parallel.fsdp).
        trains = getattr(options, "indexer_loss_coeff", 0.0) > 0
        replicated = {p for name, p in model.named_parameters() if trains and is_indexer_parameter(name)}
        _parallel_pass("fsdp", "apply_fsdp", f"fsdp={pmesh.layout.fsdp}")(model, pmesh, replicated=replicated)
    if pmesh is not None:
        from genolong.parallel.grad_sync import GradientSync

        grads = GradientSync(model, pmesh)
    return Parallelized(model, policy, memory, compiled, grads, pmesh)


def compile_pass_on(setting: bool | None, on_gpu: bool, kernels: str) -> bool:
    """Whether the compile pass runs: `--compile` / `--no-compile` as given; unset, on the GPU with
    the fused kernels (where it was measured faster), off elsewhere (the CPU's compilation takes
    minutes of gcc for a smaller gain; the reference kernels are for checking, not speed)."""
    if setting is not None:
        return setting
    return on_gpu and kernels != ops.REFERENCE


def _parallel_pass(module: str, function: str, what: str):
    """genolong.parallel.<module>.<function>, or a one-line error when this build lacks it."""
    try:
        found = importlib.import_module(f"genolong.parallel.{module}")
    except ModuleNotFoundError as err:
        if err.name != f"genolong.parallel.{module}":
            raise
        found = None
    if found is None or not hasattr(found, function):
        raise GenolongError(f"--parallel {what} needs genolong.parallel.{module}.{function}, which this build of genolong lacks; use {what.split('=')[0]}=1")
    return getattr(found, function)
