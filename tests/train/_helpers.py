"""Shared set-up for the training tests: a small prepared genome and tiny-model options."""

from pathlib import Path

from genolong.data import prepare
from genolong.data.synthetic import write_fasta
from genolong.train.options import MemoryOptions, TrainOptions

RECORDS = [("chr1", 20000), ("chr2", 12000), ("chr22", 9000)]


def prepared_genome(root: Path) -> Path:
    """Random-sequence FASTA with N runs and soft-masked repeats, prepared (train chr1-2, holdout chr22)."""
    out = root / "prep"
    if not out.exists():
        write_fasta(root / "g.fa", RECORDS, seed=0)
        prepare(root / "g.fa", out, train="chr1,chr2", holdout="chr22", progress=False, log=lambda _m: None)
    return out


def tiny_options(data: Path, out: Path, **changes) -> TrainOptions:
    """A CPU run of the tiny preset at 256 tokens; recompute on, offload off (no pinned memory on CPU)."""
    fields = {
        "data": str(data),
        "out": str(out),
        "seq_len": 256,
        "preset": "tiny",
        "steps": 6,
        "lr": 2e-3,
        "warmup": 2,
        "device": "cpu",
        "progress": False,
        "tensorboard": False,
        "memory": MemoryOptions(offload=False),
    }
    fields.update(changes)
    return TrainOptions(**fields)
