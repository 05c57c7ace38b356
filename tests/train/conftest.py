"""Fixtures shared by the training tests."""

import pytest

from tests.train._helpers import prepared_genome


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small prepared synthetic genome, one per test module."""
    return prepared_genome(tmp_path_factory.mktemp("genome"))
