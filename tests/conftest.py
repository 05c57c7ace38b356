import os

import pytest

# Keep CPU tests deterministic and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config, items):
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
