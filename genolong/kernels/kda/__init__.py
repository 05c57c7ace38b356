"""KDA ("kda", "kda_short_conv") through flash-linear-attention's kernels.

- fla_chunk.py: `fla.ops.kda.chunk_kda`; fla_conv.py: `fla.modules.causal_conv1d`.
- reference.py: the plain-PyTorch references.
"""

from genolong.kernels.kda.fla_chunk import kda_fla
from genolong.kernels.kda.fla_conv import short_conv_fla

__all__ = ["kda_fla", "short_conv_fla"]
