import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    # The model tests' shapes gain nothing from a second thread, and on a shared 2-core machine
    # OpenMP's spinning barriers made them ~30x slower (2k tokens: 30 s instead of 1 s).
    yield
