"""The plain-PyTorch references of the MoE kernels beside them.

- `moe_experts_reference` (genolong.model.moe): the "moe_experts" op, registered by the model.
- `combine_index_add`, `dispatch_index` (combine.py), `swiglu_eager` (grouped.py): the plain forms
  of the grouped path's pieces (GENOLONG_MOE_COMBINE=index_add, GENOLONG_MOE_DISPATCH=index,
  GENOLONG_MOE_SWIGLU=eager); `torch.topk` is the router top-k kernel's (GENOLONG_ROUTER_TOPK=torch).
"""

from genolong.kernels.moe.combine import combine_index_add, dispatch_index
from genolong.kernels.moe.grouped import swiglu_eager
from genolong.model.moe import moe_experts_reference

__all__ = ["combine_index_add", "dispatch_index", "moe_experts_reference", "swiglu_eager"]
