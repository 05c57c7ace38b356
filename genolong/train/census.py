"""What autograd keeps for backward, measured: the bytes of the tensors a call saves.

The memory plan counts saved activations tensor by tensor from the model code
(genolong.train.plan.layer_saved_items); this is the measurement it is checked against, on the
CPU in the tests and on the GPU in benchmarks/bench_train.py. Storages are counted once (views
share them), and storages the caller names in `exclude` (parameters, the input itself) not at all.
`backward_working_set` measures the other half of a layer's figure on the CPU: what its backward
holds above that.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def saved_bytes(call: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saved during `call()`, what `call()` returned)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    return sum(saved.values()), out


def layer_saved_bytes_per_token(layer: torch.nn.Module, streams: torch.Tensor) -> float:
    """Saved bytes per token of one decoder layer on `streams` [B, T, n_streams, hidden], without
    its parameters, buffers and input (what the plan's layer_saved_bytes estimates)."""
    exclude = [*layer.parameters(), *layer.buffers(), streams]
    total, _ = saved_bytes(lambda: layer(streams), exclude)
    return total / (streams.shape[0] * streams.shape[1])


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages that the ops run under it create and that are still alive; its peak
    less the parameter gradients that exist at each op (`grads()`). An output that shares a storage
    with an input (a view, an in-place op) is not new."""

    def __init__(self, grads: Callable[[], int]) -> None:
        super().__init__()
        self.grads, self.live, self.peak = grads, 0, 0
        self._sizes: dict[int, int] = {}

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself (its Python object is kept while it lives)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        weakref.finalize(storage, self._gone, key)

    def _gone(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        self.peak = max(self.peak, self.live - self.grads())
        return out


def backward_working_set(call: Callable, x: torch.Tensor, params: Iterable[torch.Tensor]) -> int:
    """Peak bytes that the backward of `call(x)` under the training's checkpoint
    (genolong.train.recompute) allocates above what its forward left, the incoming gradient (ones)
    included and every parameter gradient left out once it exists: the CPU counterpart of
    benchmarks/bench_real_layers.py's recompute working set, which the plan's per-layer rule
    (genolong.train.plan.backward_peaks) is checked against. It counts a weight gradient until its
    parameter holds it (the GPU measurement, between gradient accumulations, does not), so use it
    where the weights are small beside the activations, or compare two runs that differ in one term."""
    from genolong.train.recompute import checkpointed

    params = list(params)

    def grads() -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)

    for p in (*params, x):
        p.grad = None
    out = checkpointed(call, x)
    tracker = _LiveBytes(grads)
    with tracker:
        out.backward(torch.ones_like(out))
    return tracker.peak
