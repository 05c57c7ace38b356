"""The plain-PyTorch references of the KDA kernels beside them (genolong.model.kda owns them: they
are what the CPU runs, registered by the model)."""

from genolong.model.kda import kda_reference, short_conv_reference

__all__ = ["kda_reference", "short_conv_reference"]
