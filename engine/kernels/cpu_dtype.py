"""The compute dtype that `--dtype auto` takes on a CPU with the native kernels: bf16 where
the CPU has AVX512-BF16 dot products (twice fp32's arithmetic, half its bytes), else whichever
of bf16 and fp32 the packed linears run faster here, timed once and kept in the kernel cache
per CPU and instruction level. The design is in docs/design/kernels.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from engine.kernels.cpu import CpuKernels, cpu_fingerprint, kernel_dir

log = logging.getLogger(__name__)

# the probe: a 2048 x 2048 projection (a 1-3B model's attention output), one row (a decode
# step of one sequence: bound by reading the weights) and 16 rows (a batch of decode steps or
# a short prefill chunk: bound by the arithmetic)
_SHAPE = (2048, 2048)
_ROWS = (1, 16)
_RUNS = 5
_CANDIDATES = (torch.bfloat16, torch.float32)


def fastest_cpu_dtype(kernels: CpuKernels, cache_dir: str | None) -> torch.dtype:
    """bf16 with AVX512-BF16 or without native linears at all (torch's kernels serve them);
    otherwise the faster of bf16 and fp32 by `probe_cpu_dtype`, measured once per CPU and
    instruction level and then read back from the kernel cache."""
    if kernels.has_avx512_bf16 or not (kernels.has_bf16_linear and kernels.has_f32_linear):
        return torch.bfloat16
    key = hashlib.sha256(f"{kernels.isa} {cpu_fingerprint()}".encode()).hexdigest()[:16]
    path = kernel_dir(cache_dir) / f"dtype-{kernels.isa}-{key}.json"
    try:
        name = json.loads(path.read_text())["dtype"]
        if name in ("bfloat16", "float32"):
            return torch.bfloat16 if name == "bfloat16" else torch.float32
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = probe_cpu_dtype(kernels)
    best = min(timings, key=lambda d: timings[d])
    log.info(
        "dtype auto: %s (probe on %s: %s)",
        best,
        kernels.isa,
        ", ".join(f"{d} {t * 1e3:.2f} ms" for d, t in timings.items()),
    )
    _write(
        path,
        {
            "dtype": str(best).removeprefix("torch."),
            "isa": kernels.isa,
            "seconds": {str(d).removeprefix("torch."): t for d, t in timings.items()},
        },
    )
    return best


def probe_cpu_dtype(kernels: CpuKernels) -> dict[torch.dtype, float]:
    """Seconds per candidate dtype: each probe product's best of `_RUNS`, summed. The runs
    take turns between the candidates, so that a neighbour's load on a shared machine falls
    on both alike."""
    g = torch.Generator().manual_seed(0)
    n, k = _SHAPE
    weight = torch.randn(n, k, generator=g) * k**-0.5
    xs = [torch.randn(rows, k, generator=g) for rows in _ROWS]
    cases = [
        (dtype, kernels.pack(weight.to(dtype)), x.to(dtype)) for dtype in _CANDIDATES for x in xs
    ]
    best = [float("inf")] * len(cases)
    for run in range(_RUNS + 1):  # the first run warms pages, caches and threads
        for i, (dtype, packed, x) in enumerate(cases):
            start = time.perf_counter()
            kernels.linear_packed(x, packed, None, n, dtype)
            if run:
                best[i] = min(best[i], time.perf_counter() - start)
    out = dict.fromkeys(_CANDIDATES, 0.0)
    for (dtype, _, _), seconds in zip(cases, best, strict=True):
        out[dtype] += seconds
    return out


def _write(path: Path, record: dict[str, object]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError as exc:  # a read-only cache: measure again next time
        log.warning("could not keep the dtype probe in %s: %s", path.parent, exc)
