"""`ModuleWrapper`: the base of the training passes' wrappers (Recompute, Offload, ChunkedMoE, ...).

A pass puts a wrapper where a module was (`wrap(parent, name, Wrapper, ...)`), so that
print(model) shows what runs around each module, e.g.

    (0): Offload(
      layer 0, decided at the first forward
      (wrapped): Recompute(
        (wrapped): DecoderLayer(...

and every name stays the plain model's:

- `state_dict()` / `load_state_dict()`: a state-dict post-hook removes the `wrapped.` segment a
  wrapper adds, and a load pre-hook puts it back (as torch's checkpoint_wrapper does), so
  checkpoints, transformers export and torch.distributed.checkpoint see the plain keys;
- `named_parameters()` / `named_buffers()` / `named_modules()`: the wrapper lists the wrapped
  module under its own name, so optimizer names, weight-decay and fp32-keeping suffix rules and
  the tensor-parallel placement table read the plain names too;
- attribute access falls through to the wrapped module (`layer.reuses_topk`, `hc.expand`,
  `get_submodule("model.layers.3.self_attn")`), so the model's plain layer loop runs unchanged.

`unwrap(model, Wrapper)` puts the wrapped modules back (a pass undone).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn

SEGMENT = "wrapped"


class ModuleWrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.wrapped = module
        self.register_state_dict_post_hook(_strip_segment)
        self.register_load_state_dict_pre_hook(_insert_segment)

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self.wrapped.named_modules(memo, prefix, remove_duplicate)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == SEGMENT or SEGMENT not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules[SEGMENT], name)


def _strip_segment(module, state_dict, prefix, local_metadata) -> None:
    old = f"{prefix}{SEGMENT}."
    # Popped and re-inserted in order: this subtree's keys are the newest, so the order stays the plain model's.
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old):]] = state_dict.pop(key)


def _insert_segment(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    inner = f"{prefix}{SEGMENT}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def innermost(module: nn.Module) -> nn.Module:
    """The plain module under any number of wrappers."""
    while isinstance(module, ModuleWrapper):
        module = module.wrapped
    return module


def wrap(parent: nn.Module, name: str, wrapper: type[ModuleWrapper], *args, **kwargs) -> ModuleWrapper:
    """Replace child `name` of `parent` by `wrapper(child, *args, **kwargs)`; returns the wrapper."""
    wrapped = wrapper(parent._modules[name], *args, **kwargs)
    parent._modules[name] = wrapped
    return wrapped


def wrappers(model: nn.Module, kind: type[ModuleWrapper]) -> list[ModuleWrapper]:
    return [m for m in model.modules() if isinstance(m, kind)]


def unwrap(model: nn.Module, kind: type[ModuleWrapper]) -> int:
    """Remove every `kind` wrapper from `model` (the wrapped module takes its place); returns how many."""
    removed = 0
    for parent in list(_all_modules(model)):
        for name, child in list(parent._modules.items()):
            while isinstance(child, kind):
                child = child.wrapped
                removed += 1
            parent._modules[name] = child
    return removed


def _all_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module including wrappers, parents before children (modules() already yields both)."""
    seen: set[int] = set()
    for module in model.modules():
        if id(module) not in seen:
            seen.add(id(module))
            yield module
