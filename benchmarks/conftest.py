"""pytest-benchmark runs of the benchmark scripts: `-m cpu` runs them at tiny sizes on the
CPU (CI, so they cannot rot), `-m gpu` at the sizes of the committed tables (device)."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
