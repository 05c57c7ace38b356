"""genolong.data: FASTA -> tokenized, split, memory-mapped records (`prepare`), and windows of them.

    pg = open_prepared("data/hg38")
    for w in WindowSampler(pg, split="train", length="512k", seed=0): ...
    for w in tile_windows(pg, split="holdout", length="512k"): ...

Format and semantics: docs/data.md.
"""

from pathlib import Path

from genolong.data.prepare import prepare
from genolong.data.prepared import PreparedGenome, open_prepared
from genolong.data.sampler import Window, WindowSampler, reverse_complement, tile_windows

BUNDLED_GENOME = "ecoli536_lambda.fa.gz"
# Default splits of the bundled genome: see genolong/data/genomes/README.md.
BUNDLED_TRAIN = "NC_008253.1"
BUNDLED_HOLDOUT = "NC_001416.1"


def bundled_genome_path() -> Path:
    """The small real genome shipped with genolong (E. coli 536 + phage lambda, bgzip, indexed)."""
    return Path(__file__).parent / "genomes" / BUNDLED_GENOME


__all__ = [
    "BUNDLED_HOLDOUT",
    "BUNDLED_TRAIN",
    "PreparedGenome",
    "Window",
    "WindowSampler",
    "bundled_genome_path",
    "open_prepared",
    "prepare",
    "reverse_complement",
    "tile_windows",
]
