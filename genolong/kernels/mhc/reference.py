"""The plain-PyTorch references of the mHC kernels beside them (genolong.model.mhc and mhc_math own
them: they are what the CPU runs, registered by the model)."""

from genolong.model.mhc import expand_reference, mix_collapse_reference
from genolong.model.mhc_math import sinkhorn

__all__ = ["expand_reference", "mix_collapse_reference", "sinkhorn"]
