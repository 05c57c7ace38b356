"""The MoE experts ("moe_experts") on torch._grouped_mm, with Triton pieces around it.

- grouped.py: the token-chunked grouped path; combine.py: the read-side combine and dispatch;
  swiglu.py: the clamped SwiGLU, one pass each way; router_topk.py: the router's top-k kernel.
- reference.py: the plain-PyTorch references.
"""

from genolong.kernels.moe.grouped import moe_experts_grouped

__all__ = ["moe_experts_grouped"]
