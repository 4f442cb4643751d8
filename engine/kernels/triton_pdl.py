"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper GPUs and newer.

A kernel launched with `launch_options(True)` may start while the kernel before it in the
stream (or CUDA graph) is still running, once every program of that kernel has called
`release` (or ended). Until it calls `wait`, which returns when the kernel before has
finished and its writes are visible, it may only read what no kernel writes: the FP8 GEMV
loads its first weight tile there, streamed while the kernel before drains. Each kernel
that takes part calls `wait` before any other load and before any store, so none overtakes
the one before it and none writes a buffer another may still read. All but the paged
attention kernel call `release` first. Attention did too at first: its merge kernel then
started early and waited on the SMs, and the 16-bit step over 2,048 tokens took 5.22 ms
against 4.8-5.0 ms in other runs (one H200 run, gpu_decode-cuda-20261127T234641Z.json), so
it no longer does. Where PDL is off, both calls compile to nothing. Design:
docs/design/kernels.md, "Programmatic dependent launch".
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

try:  # Triton 3.3 on; without it the engine never turns PDL on (triton_backend.pdl_supported)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # pragma: no cover - an older Triton
    AVAILABLE = False


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel start (it runs up to its own `wait`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before has finished and its writes are visible."""
    if PDL:
        gdc_wait()


def launch_options(pdl: bool) -> dict[str, Any]:
    """Keyword arguments of a kernel launch: with `pdl`, the launch that lets the kernel
    start early (its code must call `wait` before it reads or writes anything not constant)."""
    return {"launch_pdl": True} if pdl else {}
