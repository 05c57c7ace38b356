"""The DSA lightning indexer's fused paths: the selection ("dsa_indexer_topk"), its KL loss
("dsa_indexer_loss") and the kept selection's passes.

- topk.py: the op through the Triton passes (v2 selects inside pass 2, v1 with torch.topk) and the
  plain query-chunked PyTorch version; triton_kernels.py: the passes.
- loss.py, loss_triton.py: the indexer's sparse-stage KL loss and its gradient.
- kept_selection.py: the kept selection's pack check and expansion, one Triton pass each.
- reference.py: the plain-PyTorch references.
"""

from genolong.kernels.indexer.loss import dsa_indexer_loss_fused
from genolong.kernels.indexer.topk import dsa_indexer_topk_chunked, dsa_indexer_topk_fused, dsa_indexer_topk_fused_select

__all__ = ["dsa_indexer_loss_fused", "dsa_indexer_topk_chunked", "dsa_indexer_topk_fused", "dsa_indexer_topk_fused_select"]
