"""Fixtures shared by the training tests."""

import os

import pytest
import torch

from tests.train._helpers import prepared_genome

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



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small prepared synthetic genome, one per test module."""
    return prepared_genome(tmp_path_factory.mktemp("genome"))
