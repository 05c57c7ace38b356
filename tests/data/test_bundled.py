"""The genome shipped in the package: small, documented, and prepared end to end by the CLI."""

import gzip
import hashlib

import numpy as np

from genolong.data import BUNDLED_HOLDOUT, BUNDLED_TRAIN, bundled_genome_path, open_prepared

from .conftest import run_cli

LENGTHS = {"NC_008253.1": 4_938_920, "NC_001416.1": 48_502}  # NCBI RefSeq record lengths


def test_bundled_files_are_small_and_documented():
    path = bundled_genome_path()
    assert path.is_file() and path.stat().st_size < 2 * 1024 * 1024
    assert (path.parent / (path.name + ".fai")).is_file() and (path.parent / (path.name + ".gzi")).is_file()
    readme = (path.parent / "README.md").read_text()
    for fact in ("NC_008253", "NC_001416", "bowtie-examples", "bowtie2-examples", "public domain"):
        assert fact in readme


def test_prepare_bundled_through_the_cli(tmp_path):
    result = run_cli("prepare", "--fasta", "bundled", "--out", str(tmp_path / "demo"), fresh=True)
    assert result.returncode == 0, result.stderr
    pg = open_prepared(tmp_path / "demo")
    assert pg.records("train") == [(BUNDLED_TRAIN, LENGTHS[BUNDLED_TRAIN])]
    assert pg.records("holdout") == [(BUNDLED_HOLDOUT, LENGTHS[BUNDLED_HOLDOUT])]
    raw = bundled_genome_path().read_bytes()
    assert pg.manifest["source"]["sha256"] == hashlib.sha256(raw).hexdigest()
    # Independent decode: gzip + numpy lookup, no genolong code.
    text = gzip.decompress(raw).split(b"\n>")
    lut = np.full(256, 255, dtype=np.uint8)
    for i, base in enumerate(b"ACGTN"):
        lut[base] = i
    for block in text:
        header, _, body = block.lstrip(b">").partition(b"\n")
        name = header.split()[0].decode()
        expected = lut[np.frombuffer(body.replace(b"\n", b""), dtype=np.uint8)]
        split = "train" if name == BUNDLED_TRAIN else "holdout"
        tokens, mask = pg.read(split, name, 0, LENGTHS[name])
        assert np.array_equal(tokens, expected) and not mask.any()
