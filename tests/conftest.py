import os

# One intra-op thread for the whole suite (and, through the environment, every process it starts):
# the test models are tiny, so a second thread gains nothing, and when the two cores are busy
# OpenMP threads spin-waiting on each other made a small op ~20x slower (eval-positional's end-to-end
# test: 303 s with two threads, 20 s with one, on the shared 2-core machine). OMP_NUM_THREADS overrides.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _seconds(item) -> float:
    """A test's rough cost on the 2-core CPU machine: `slow(seconds=N)`, 10 for a bare `slow`, else 0."""
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else float(mark.kwargs.get("seconds", 10))


def _file(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    # The modules with the longest tests first, the longest first; each module's tests stay together
    # and in their order, so a module fixture is not built again. `--dist worksteal` gives the first
    # half of this order to one worker and the second to the other, and an idle worker steals the back
    # half of the other's queue: the long tests start at once and both workers end on short ones. In
    # file order a 100 s test could start last and run alone.
    cost = {}
    for item in items:
        cost[_file(item)] = max(cost.get(_file(item), 0.0), _seconds(item))
    items.sort(key=lambda item: cost[_file(item)], reverse=True)  # stable: ties keep the file order

    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "/gpu/" in str(item.fspath):
            item.add_marker(skip)


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
