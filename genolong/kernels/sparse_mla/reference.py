"""The plain-PyTorch references of the sparse-MLA kernels beside them.

- `sparse_attention_reference` (genolong.model.dsa): the "dsa_sparse_attention" op, registered by
  the model; `sparse_attention_replay_reference` (genolong.model.sparse_replay): its replay from a
  kept (out, lse). The model owns them (they are what the CPU runs); they are named here so that
  the reference of every kernel in this package is found beside it.
- `ascending_bounds_reference`: the key-chunked backward's row bounds, the reference of
  chunk_bounds.py's one-pass kernel and the form used where that kernel cannot run.
"""

from __future__ import annotations

import torch

from genolong.model.dsa import sparse_attention_reference
from genolong.model.sparse_replay import sparse_attention_replay_reference

__all__ = ["ascending_bounds_reference", "sparse_attention_reference", "sparse_attention_replay_reference"]


def ascending_bounds_reference(idx: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds [n, C + 1] int32 of rows walked as they are, a 0-d bool "every row ascends apart from
    its empty slots") in PyTorch: the reference of chunk_bounds.ascending_bounds, equal to it
    exactly (integers only), and the form used where that kernel cannot run. The bounds come from
    each slot's smallest key at or after it, which ascends: an empty slot joins the range of the
    next key (the kernel skips it), trailing ones no range."""
    filled = torch.where(idx >= 0, idx, torch.iinfo(idx.dtype).max)
    suffix_min = filled.flip(-1).cummin(-1).values.flip(-1)
    del filled
    ascends = ((idx < 0) | (idx == suffix_min)).all()
    return searched_bounds(suffix_min, edges), ascends


def searched_bounds(ascending: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(ascending, edges.expand(ascending.shape[0], -1).contiguous(), out_int32=True)
