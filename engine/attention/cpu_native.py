"""The native CPU decode-attention kernel: compiled on first use, called through ctypes.

The C source in `csrc/` is built with the system C compiler into a cache directory keyed by
the source hash, compiler and CPU flags, then loaded with ctypes (which releases the GIL
during the call). OpenMP resolves to the runtime torch already loaded, so both share one
thread pool. If no compiler is available, `load_decode_kernel` returns None and the torch
backend is used instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "csrc"
_SOURCES = ("paged_decode.c", "paged_decode_impl.h")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class KernelError(RuntimeError):
    """The native kernel rejected its inputs (an unsupported shape)."""


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(cache_dir: Path, compiler: str) -> Path:
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((_SRC_DIR / name).read_bytes())
    digest.update(" ".join([compiler, *_FLAGS, _cpu_fingerprint()]).encode())
    target = cache_dir / f"paged_decode-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *_FLAGS, str(_SRC_DIR / "paged_decode.c"), "-o", str(out), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(out, target)  # atomic: a concurrent build never sees half a file
    return target


class DecodeKernel:
    """Typed wrapper over the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [_ptr] * 6 + [_i64] * 6 + [ctypes.c_float]
        self._fns = {}
        for dtype, name in (
            (torch.float32, "paged_decode_f32"),
            (torch.bfloat16, "paged_decode_bf16"),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._fns

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, H, D]; pages: [N, block, Hkv, D]; block_tables: [B, M] int64;
        seq_lens: [B] int32 -> [B, H, D]. Reads the pages in place; writes nothing else."""
        assert q.is_contiguous()
        assert k_pages.is_contiguous()
        assert v_pages.is_contiguous()
        assert block_tables.dtype == torch.int64
        assert block_tables.is_contiguous()
        assert seq_lens.dtype == torch.int32
        assert seq_lens.is_contiguous()
        b, h, d = q.shape
        _, block_size, hkv, _ = k_pages.shape
        out = torch.empty_like(q)
        rc = self._fns[q.dtype](
            q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), out.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(),
            b, h, hkv, d, block_size, block_tables.shape[1], scale,
        )  # fmt: skip
        if rc != 0:
            raise KernelError(f"paged decode kernel rejected its inputs (code {rc})")
        return out


def load_decode_kernel(cache_dir: str | None) -> DecodeKernel | None:
    """Build (once) and load the kernel; None when this machine cannot build it."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or platform.system() != "Linux":
        log.info("no C compiler found; CPU attention uses the torch backend")
        return None
    base = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "strata-kernels"
    try:
        path = _build(base / "kernels", compiler)
        return DecodeKernel(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning(
            "native CPU attention unavailable (%s); using the torch backend",
            detail.strip().splitlines()[-1] if detail.strip() else exc,
        )
        return None
