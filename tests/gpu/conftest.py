"""GPU tests run only where CUDA is available; elsewhere they are reported as skipped.

Those that run the default model (through the `strata_cache_dir` fixture) are also marked
`model`, so that a GPU machine without the model's file yet can run the others first
(`pytest -m "not model" tests/gpu`, see `make bench-gpu-quick`)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords and "strata_cache_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
