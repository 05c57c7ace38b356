"""Shared set-up for the training tests: a small prepared genome and tiny-model options."""

import os
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread (here and in spawned workers) for the tiny model's small ops: on a
    2-core machine a second thread gains nothing, and when the cores are shared, OpenMP threads
    spin-waiting on each other made these tests 5x slower. Restored after the module."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env
