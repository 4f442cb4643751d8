"""Marks for tests of the Triton kernels."""

from __future__ import annotations

import os

import pytest

# Tests that run the kernels on CPU tensors need Triton's interpreter, which engine/__init__
# selects on machines without a GPU driver; where Triton compiles for a GPU, tests/gpu runs
# the compiled kernels instead.
INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles for the GPU here; tests/gpu checks the compiled kernels",
)
