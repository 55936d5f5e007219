import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# tests that start several processes (torchrun) or the whole demo: `-m "not slow"` leaves them out
SLOW_PATHS = ("distributed", "test_demo.py")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if any(part in SLOW_PATHS for part in item.path.parts):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
