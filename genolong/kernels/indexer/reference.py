"""The plain-PyTorch references of the indexer kernels beside them (the model owns them: they are
what the CPU runs, registered by genolong.model).

- `indexer_topk_reference` (genolong.model.indexer): the "dsa_indexer_topk" op; topk.py's
  `indexer_chunked` is the same selection, memory-budgeted, and its `*_torch` functions are the
  references of each Triton pass.
- `indexer_loss_reference` (genolong.model.indexer_loss): the "dsa_indexer_loss" op.
- `pack_selection` / `unpack_selection` (genolong.model.kept_selection): the kept selection's
  PyTorch passes, the reference of kept_selection.py.
"""

from genolong.model.indexer import indexer_topk_reference
from genolong.model.indexer_loss import indexer_loss_reference
from genolong.model.kept_selection import pack_selection, unpack_selection

__all__ = ["indexer_loss_reference", "indexer_topk_reference", "pack_selection", "unpack_selection"]
