"""Fixtures shared by the training tests."""

import pytest

from genolong.data import BUNDLED_HOLDOUT, BUNDLED_TRAIN, bundled_genome_path, open_prepared, prepare
from tests.train._helpers import prepared_genome


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small prepared synthetic genome, one per test module."""
    return prepared_genome(tmp_path_factory.mktemp("genome"))


@pytest.fixture(scope="module")
def lambda_dna(tmp_path_factory):
    """Real DNA: the bundled genome with phage lambda (48 kb, plenty for short windows) to train on."""
    out = tmp_path_factory.mktemp("lambda") / "prep"
    prepare(bundled_genome_path(), out, train=BUNDLED_HOLDOUT, holdout=BUNDLED_TRAIN, progress=False, log=lambda _m: None)
    return open_prepared(out)


@pytest.fixture(scope="module")
def ecoli_dna(tmp_path_factory):
    """Real DNA: the bundled genome as `genolong prepare --fasta bundled` splits it (E. coli 536 to train on)."""
    out = tmp_path_factory.mktemp("ecoli") / "prep"
    prepare(bundled_genome_path(), out, train=BUNDLED_TRAIN, holdout=BUNDLED_HOLDOUT, progress=False, log=lambda _m: None)
    return open_prepared(out)
