"""DSA sparse attention ("dsa_sparse_attention", docs/ops.md) over the MLA latent.

- op.py: the op on genolong's few-head Triton kernels (launch configs, the key-chunked backward,
  autograd, the replay); triton_kernels.py: the Triton kernels; chunk_bounds.py: the backward's row
  bounds in one pass; row_order.py: the rows' order learned without a host sync.
- tilelang.py: megatron-core's padded TileLang kernel, the alternative (GENOLONG_SPARSE_MLA=off).
- reference.py: the plain-PyTorch references.
"""

from genolong.kernels.sparse_mla.op import dsa_sparse_attention, replay_dsa_sparse_attention, sparse_mla

__all__ = ["dsa_sparse_attention", "replay_dsa_sparse_attention", "sparse_mla"]
