"""mHC's hyper-connections ("mhc_mix_collapse", "mhc_expand") in Triton.

- fused.py: the six passes over the streams; sinkhorn.py: the Sinkhorn normalisation, one kernel
  per direction, and the custom op torch.compile sees.
- reference.py: the plain-PyTorch references.
"""

from genolong.kernels.mhc.fused import mhc_expand_fused, mhc_mix_collapse_fused

__all__ = ["mhc_expand_fused", "mhc_mix_collapse_fused"]
