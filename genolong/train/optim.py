"""AdamW with fp32 master weights and state, global-norm clipping, warmup + cosine schedule.

Precision choice (docs/training.md): on the GPU the model's parameters are bf16 and this
optimizer keeps an fp32 master copy plus fp32 moments (16 bytes per parameter with the bf16
gradient). The alternative, fp32 parameters under bf16 autocast, costs the same per parameter
but leaves every activation that is not a matmul output in fp32: the 4 mHC residual streams,
norms and gates. At 512k tokens one layer's 4-stream input is 16 GiB in bf16 and 32 GiB in fp32,
and those are exactly the tensors recompute keeps and offload moves; bf16 parameters halve them.

fp32 parameters (the CPU default) are their own master copy, so nothing is duplicated there.
The update runs as multi-tensor (foreach) operations over buckets of parameters of at most
_BUCKET_BYTES of fp32 each: a few calls per bucket instead of ~10 per parameter (the model has
hundreds of small tensors), while the fp32 gradient copies of bf16 parameters exist for one
bucket at a time, never for the whole model.

Under FSDP (genolong.parallel.fsdp) a parameter and its gradient are DTensors holding this
rank's chunk: the optimizer works on the chunks (`_local`), so masters and moments are sharded
too, and `state_dict()` returns them as DTensors laid out as their parameters (what
torch.distributed.checkpoint needs to save and load them at any layout).

A step may update only some parameters (`step(..., only=names)`: the DSA indexer's warm-up,
genolong/train/indexer.py). Each parameter then counts its own steps for Adam's bias
correction, so the rest of the model starts its own updates later as if from step 1; when
every step updates everything (the default) the counts equal the global one.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch.distributed.tensor import DTensor

# fp32 bytes of parameters updated by one group of multi-tensor calls.
_BUCKET_BYTES = 256 << 20


class MasterAdamW:
    """Decoupled-weight-decay Adam (as torch.optim.AdamW) over fp32 masters of `named_params`.

    Parameters for which `no_decay(name, param)` is true get no weight decay (default_no_decay).
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        no_decay=None,
    ):
        self.params = {name: p for name, p in named_params if p.requires_grad}
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        no_decay = no_decay or default_no_decay
        self.decay = {name: not no_decay(name, p) for name, p in self.params.items()}
        self.master = {
            name: (_local(p.detach()) if p.dtype == torch.float32 else _local(p.detach()).float().clone()) for name, p in self.params.items()
        }
        self.exp_avg = {name: torch.zeros_like(m) for name, m in self.master.items()}
        self.exp_avg_sq = {name: torch.zeros_like(m) for name, m in self.master.items()}
        self.step_count = 0
        self.param_steps = dict.fromkeys(self.params, 0)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of all gradients, accumulated in fp32 (inf/nan when any gradient is)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in self.params.values():
            if p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(_local(p.grad))
        total = 0.0
        for grads in by_device.values():
            # fp32 accumulation without an fp32 copy of the gradient (the embedding's is GiBs).
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            total += torch.linalg.vector_norm(torch.stack(norms)).square().item()
        return math.sqrt(total)

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0, only: Collection[str] | None = None) -> None:
        """One AdamW update at learning rate `lr`, gradients multiplied by `grad_scale` (clipping);
        `only`: the names of the parameters this step may update (None: all)."""
        self.step_count += 1
        b1, b2 = self.betas
        updated = [name for name in self.params if only is None or name in only]
        for name in updated:
            self.param_steps[name] += 1
        for (decay, steps), names in self._buckets(updated):
            bias1 = 1 - b1**steps
            bias2 = 1 - b2**steps
            masters = [self.master[n] for n in names]
            m = [self.exp_avg[n] for n in names]
            v = [self.exp_avg_sq[n] for n in names]
            g = [_local(self.params[n].grad).float() for n in names]
            if grad_scale != 1.0:
                g = torch._foreach_mul(g, grad_scale)
            if decay and self.weight_decay:
                torch._foreach_mul_(masters, 1 - lr * self.weight_decay)
            torch._foreach_lerp_(m, g, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, g, g, value=1 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(bias2))
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(masters, m, denom, value=-lr / bias1)
            copies = [n for n in names if self.master[n].data_ptr() != _local(self.params[n]).data_ptr()]
            if copies:
                torch._foreach_copy_([_local(self.params[n]) for n in copies], [self.master[n] for n in copies])
            del g, denom

    def _buckets(self, names: list[str]) -> list[tuple[tuple[bool, int], list[str]]]:
        """((decay, step count), names) of those of `names` that have a gradient, grouped by device,
        decay and step count (the bias correction), each group cut into runs of at most
        _BUCKET_BYTES of fp32 (a larger tensor alone)."""
        groups: dict[tuple, list[list[str]]] = {}
        sizes: dict[tuple, int] = {}
        for name in names:
            p = self.params[name]
            if p.grad is None:
                continue
            key = (p.device, self.decay[name], self.param_steps[name])
            nbytes = 4 * _local(p).numel()
            runs = groups.setdefault(key, [[]])
            if runs[-1] and sizes[key] + nbytes > _BUCKET_BYTES:
                runs.append([])
                sizes[key] = 0
            runs[-1].append(name)
            sizes[key] = sizes.get(key, 0) + nbytes
        return [((decay, steps), run) for (_, decay, steps), runs in groups.items() for run in runs]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat {name: tensor} (safetensors-ready); the step count is a 0-d tensor. The tensors of an
        FSDP-sharded parameter are DTensor views of this rank's chunks (no copy)."""
        out: dict[str, torch.Tensor] = {"step": torch.tensor(self.step_count, dtype=torch.int64)}
        for name, p in self.params.items():
            if self.param_steps[name] != self.step_count:
                out[f"step.{name}"] = torch.tensor(self.param_steps[name], dtype=torch.int64)
            out[f"master.{name}"] = _like(self.master[name], p)
            out[f"exp_avg.{name}"] = _like(self.exp_avg[name], p)
            out[f"exp_avg_sq.{name}"] = _like(self.exp_avg_sq[name], p)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.params if f"master.{n}" not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {len(missing)} parameters, e.g. {missing[:3]}")
        self.step_count = int(state["step"])
        for name, p in self.params.items():
            self.param_steps[name] = int(state.get(f"step.{name}", self.step_count))
            for kind, mine in (("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                saved = _local(state[f"{kind}.{name}"])
                if saved.data_ptr() != mine[name].data_ptr():
                    mine[name].copy_(saved)
            if self.master[name].data_ptr() != _local(p).data_ptr():
                _local(p).copy_(self.master[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of an FSDP-sharded tensor (a view), any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (param's local chunk's shape) as a DTensor laid out as an FSDP-sharded `param`."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False)


def default_no_decay(name: str, p: torch.Tensor) -> bool:
    """No weight decay on vectors (norm scales, biases, gate biases, A_log, dt_bias) nor on the
    token embedding: fine-tuning a GLM checkpoint on DNA touches 5 of its 154,880 rows, and decay
    would shrink all the others without any gradient to hold them."""
    return p.dim() < 2 or "embed_tokens" in name


def clip_scale(grad_norm: float, max_norm: float) -> float:
    """Factor that brings the global gradient norm down to `max_norm` (1.0 if below or disabled)."""
    if max_norm <= 0 or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate for 0-based `step`: linear warmup over `warmup` steps, then cosine to base*min_ratio.

    The first step already uses base/warmup (not 0), so no step is wasted at lr 0; when the warmup
    leaves at least two steps (warmup <= total - 2) the last step (total - 1) uses exactly
    base*min_ratio; a longer warmup ends the run inside it or at the peak (finetune says so).
    """
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    decay_steps = max(total - warmup - 1, 1)
    progress = min(max(step - warmup, 0) / decay_steps, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
