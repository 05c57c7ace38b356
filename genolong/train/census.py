"""What autograd keeps for backward, measured: the bytes of the tensors a call saves.

The memory plan counts saved activations tensor by tensor from the model code
(genolong.train.plan.layer_saved_items); this is the measurement it is checked against, on the
CPU in the tests and on the GPU in benchmarks/bench_train.py. Storages are counted once (views
share them), and storages the caller names in `exclude` (parameters, the input itself) not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


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
