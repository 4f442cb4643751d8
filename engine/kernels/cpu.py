"""Strata's native CPU kernels: the C sources in `csrc/`, compiled on first use into a cache
keyed by sources, compiler and CPU flags, and called through ctypes (`CpuKernels`). Every
wrapper checks what the C side assumes and says what it mutates. The design is in
docs/design/kernels.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels.cpu_quant import QuantKernels, QuantWeight

log = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "csrc"
# the translation units, longest to compile first (a pool of compilers takes them in this
# order), and the headers they include
_UNITS = (
    "attention_bf16.c",
    "ops_f32.c",
    "attention_bf16_fp8.c",
    "layer.c",
    "ops_bf16.c",
    "ops.c",
    "quant.c",
)
_HEADERS = (
    "common.h",
    "fp8.h",
    "elem_f32.h",
    "elem_bf16.h",
    "linear_f32_block.h",
    "linear_f32.h",
    "kernels.h",
    "ops_impl.h",
    "attention_impl.h",
    "kv_fp8_impl.h",
    "linear.h",
    "lora.h",
    "layer.h",
    "quant.h",
)
_PANEL = 64  # output columns per packed weight panel (linear.h)
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-fno-math-errno"]
# `native` tunes for this CPU (AVX-512 paths where present, else AVX2 ones); `avx512` builds
# the AVX-512 paths without BF16 or VNNI (x86-64-v4), as such CPUs run them; `avx2` builds
# the AVX2 + FMA paths (x86-64-v3: no AVX-512) on any CPU that has them; `portable` builds the
# scalar fallbacks every kernel has. Tests compare each against the same references (the
# engine takes `native` for --cpu-isa avx512).
_ARCH = {
    "native": "-march=native",
    "avx512": "-march=x86-64-v4",
    "avx2": "-march=x86-64-v3",
    "portable": "-march=x86-64-v2",
}
# instruction level (`--cpu-isa`) -> build, and the CPU flags the level needs
_ISA_BUILD = {"avx512": "native", "avx2": "avx2", "portable": "portable"}
_ISA_FLAGS = {"avx512": {"avx512f", "avx512bw"}, "avx2": {"avx2", "fma", "f16c"}, "portable": set()}
_ABI = 11
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_PAGE_SUFFIX = {torch.float8_e4m3fn: "fp8"}  # page formats other than the compute dtype
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "strata_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, ctypes.c_int], None),
    "strata_rope": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I], None),
    "strata_silu_mul": ([_P, _P, _I, _I], None),
    "strata_kv_write": ([_P, _P, _I, _I, _P, _P, _P, _I, _I], None),
    "strata_kv_write_fp8": ([_P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _C], _C),
    "strata_paged_decode": (
        [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _C],
        _C,
    ),
}
_FP8_SIGNATURES = {"strata_paged_decode": _SIGNATURES["strata_paged_decode"]}


class KernelError(RuntimeError):
    """A native kernel rejected its inputs (an unsupported shape)."""


def _cpuinfo_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_fingerprint() -> str:
    """This machine's architecture and CPU flags: what a build, or a measurement, holds for."""
    return platform.machine() + _cpuinfo_flags()


def cpu_isa_levels() -> tuple[str, ...]:
    """The instruction levels this CPU runs, best first (`portable` everywhere)."""
    flags = set(_cpuinfo_flags().split())
    x86 = platform.machine() in ("x86_64", "AMD64")
    return tuple(isa for isa, need in _ISA_FLAGS.items() if not need or (x86 and need <= flags))


def resolve_cpu_isa(choice: str) -> str:
    """`--cpu-isa` -> the instruction level to build for: `auto` is the best this CPU has;
    a level it lacks raises ValueError."""
    levels = cpu_isa_levels()
    if choice == "auto":
        return levels[0]
    if choice not in _ISA_BUILD:
        raise ValueError(f"unknown CPU instruction level {choice!r}")
    if choice not in levels:
        raise ValueError(f"this CPU lacks {choice} (it runs {', '.join(levels)})")
    return choice


def _build(cache_dir: Path, compiler: str, arch: str) -> Path:
    flags = [*_FLAGS, _ARCH[arch]] if platform.machine() in ("x86_64", "AMD64") else _FLAGS
    digest = hashlib.sha256()
    for name in (*_UNITS, *_HEADERS):
        digest.update((_SRC_DIR / name).read_bytes())
    digest.update(" ".join([compiler, *flags, cpu_fingerprint()]).encode())
    target = cache_dir / f"strata-cpu-{arch}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # processes starting together on a fresh machine (several workers) build once: the
    # others wait for the lock, then find the library
    with open(cache_dir / ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _compile(target, compiler, flags)
    return target


def _compile(target: Path, compiler: str, flags: list[str]) -> None:
    log.info("building the native CPU kernels (once per machine)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{Path(unit).stem}.o" for unit in _UNITS]

        def compile_unit(unit: str, obj: Path) -> None:
            cmd = [compiler, *flags, "-c", str(_SRC_DIR / unit), "-o", str(obj)]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)

        # the units compile in parallel (the longest alone takes about half the total)
        with ThreadPoolExecutor(max_workers=min(len(_UNITS), os.cpu_count() or 1)) as pool:
            list(pool.map(compile_unit, _UNITS, objects))  # raises the first failure
        out = Path(tmp) / target.name
        cmd = [compiler, *flags, "-shared", *map(str, objects), "-o", str(out), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(out, target)  # atomic: a reader never sees half a file


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuKernels:
    """Typed wrappers over the compiled library (fp32 and bf16 storage)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if lib.strata_kernels_abi() != _ABI:
            raise OSError("stale kernel library")
        # the vector paths compiled in: avx512, avx2 or portable (scalar C)
        self.isa = {2: "avx512", 1: "avx2"}.get(lib.strata_isa(), "portable")
        self.has_avx512_bf16 = bool(lib.strata_has_avx512_bf16())
        self.has_bf16_linear = self.has_avx512_bf16 or self.isa == "avx2"
        self.has_f32_linear = self.isa != "portable"
        # the packed linears, per weight dtype: (packable, pack, linear)
        self._packed: dict[torch.dtype, tuple[Any, Any, Any]] = {}
        for dtype, suffix in _SUFFIX.items():
            packable = getattr(lib, f"strata_linear_packable_{suffix}")
            packable.argtypes, packable.restype = [_I, _I], ctypes.c_int
            pack = getattr(lib, f"strata_pack_{suffix}")
            pack.argtypes, pack.restype = [_P, _P, _I, _I], None
            linear = getattr(lib, f"strata_linear_packed_{suffix}")
            linear.argtypes = [_P, _P, _P, _P, _I, _I, _I, *([ctypes.c_int] * (suffix == "bf16"))]
            linear.restype = ctypes.c_int
            self._packed[dtype] = packable, pack, linear
        self._fns: dict[tuple[str, torch.dtype], Any] = {}
        for name, (args, restype) in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = args, restype
                self._fns[name, dtype] = fn
        # paged attention over FP8 pages, keyed by (name, query dtype, page dtype)
        self._page_fns: dict[tuple[str, torch.dtype, torch.dtype], Any] = {}
        for name, (args, restype) in _FP8_SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                for page_dtype, page_suffix in _PAGE_SUFFIX.items():
                    fn = getattr(lib, f"{name}_{suffix}_{page_suffix}")
                    fn.argtypes, fn.restype = args, restype
                    self._page_fns[name, dtype, page_dtype] = fn
        self._argmax = lib.strata_argmax_f32
        self._argmax.argtypes, self._argmax.restype = [_P, _P, _I, _I], None
        self._layer = lib.strata_decoder_layer_bf16
        # x, residual, first, norms, eps | 13 tensors and the weights' formats | 8 sizes |
        # scale, workspace, out
        layer_args: list[Any] = [
            _P,
            _P,
            ctypes.c_int,
            _P,
            _P,
            _F,
            *[_P] * 13,
            _C,
            *[_P] * 3,
            *[_I] * 8,
            _F,
            _P,
            _P,
            *[_P] * 7,  # LoRA: A, B^T, ranks, part ends, part counts, token slots, scratch
        ]
        self._layer.argtypes = layer_args
        self._layer.restype = ctypes.c_int
        self._stack = lib.strata_decoder_stack_bf16
        # layers, x, residual | 2 norm arrays, eps | 5 weight arrays, formats | positions,
        # cos, sin | 4 page arrays, rotated | slots, tables, lens | 8 sizes | scale,
        # workspace, 2 outs | LoRA, as for one layer, with every layer's arrays concatenated
        self._stack.argtypes = [
            _I,
            _P,
            _P,
            _P,
            _P,
            _F,
            *[_P] * 6,
            *[_P] * 3,
            *[_P] * 4,
            _C,
            *[_P] * 3,
            *[_I] * 8,
            _F,
            *[_P] * 3,
            *[_P] * 7,
        ]
        self._stack.restype = ctypes.c_int
        self._lora = lib.strata_lora_bf16
        self._lora.argtypes = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _I, _P]
        self._lora.restype = ctypes.c_int
        self._linear_lora = lib.strata_linear_lora_bf16
        self._linear_lora.argtypes = [_I, *[_P] * 4, *[_I] * 3, *[_P] * 3, _I, _P, _I, _P]
        self._linear_lora.restype = ctypes.c_int
        self.quant = QuantKernels(lib)  # linears over q8 / q4 weights (csrc/quant.h)

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _SUFFIX

    @staticmethod
    def supports_pages(dtype: torch.dtype) -> bool:
        """Whether KV pages stored in `dtype` can be written and attended (the compute dtype
        itself, or FP8 with scales)."""
        return dtype in _SUFFIX or dtype in _PAGE_SUFFIX

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. Returns (normed, x + residual); the sum is written into `residual`."""
        assert x.is_contiguous() and weight.is_contiguous()
        out = torch.empty_like(x)
        if residual is not None:
            assert residual.is_contiguous() and residual.shape == x.shape
        self._fns["strata_rms_norm", x.dtype](
            x.data_ptr(),
            _ptr(residual),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            residual is not None,
        )
        return out, (x if residual is None else residual)

    def rope_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rows may be strided views)."""
        assert q.stride(2) == 1 and q.stride(1) == q.shape[2]
        assert k.stride(2) == 1 and k.stride(1) == k.shape[2]
        assert positions.dtype == torch.int64 and positions.is_contiguous()
        assert cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        self._fns["strata_rope", q.dtype](
            q.data_ptr(),
            k.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            q.shape[0],
            q.shape[1],
            k.shape[1],
            q.shape[2],
            q.stride(0),
            k.stride(0),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up, [T, I]."""
        assert gate_up.is_contiguous()
        inter = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inter)
        self._fns["strata_silu_mul", gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter
        )
        return out

    def kv_write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        slots: torch.Tensor,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        rotate_keys: bool = False,
    ) -> None:
        """Copy k/v [T, Hkv, D] (strided rows) into pool slots; mutates the pages (and, for
        FP8 pages, quantizes into them, keys Hadamard-rotated first when `rotate_keys`, and
        writes `k_scales`/`v_scales` [N, block, Hkv])."""
        assert k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]
        assert k.stride(2) == 1 and v.stride(2) == 1
        assert k_pages.is_contiguous() and v_pages.is_contiguous()
        assert slots.dtype == torch.int64 and slots.is_contiguous()
        if k_pages.dtype in _PAGE_SUFFIX:
            _check_scales(k_pages, k_scales, v_scales)
            rc = self._fns["strata_kv_write_fp8", k.dtype](
                k.data_ptr(),
                v.data_ptr(),
                k.stride(0),
                v.stride(0),
                k_pages.data_ptr(),
                v_pages.data_ptr(),
                _ptr(k_scales),
                _ptr(v_scales),
                slots.data_ptr(),
                k.shape[0],
                k.shape[1],
                k.shape[2],
                rotate_keys,
            )
            if rc != 0:
                raise KernelError(f"FP8 page write rejected head_dim {k.shape[2]}")
            return
        assert k_pages.dtype == k.dtype and not rotate_keys
        self._fns["strata_kv_write", k.dtype](
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            slots.data_ptr(),
            k.shape[0],
            k.shape[1] * k.shape[2],
        )

    def paged_decode(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        rotated_keys: bool = False,
    ) -> torch.Tensor:
        """q: [B, H, D] (strided rows); pages: [N, block, Hkv, D] in q's dtype, or FP8 with
        `k_scales`/`v_scales` [N, block, Hkv] (keys stored rotated when `rotated_keys`);
        block_tables: [B, M] int64; seq_lens: [B] int32 -> [B, H * D]. Reads the pages in
        place."""
        assert q.stride(2) == 1 and q.stride(1) == q.shape[2]
        assert k_pages.is_contiguous() and v_pages.is_contiguous()
        assert block_tables.dtype == torch.int64 and block_tables.is_contiguous()
        assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
        b, h, d = q.shape
        _, block_size, hkv, _ = k_pages.shape
        out = q.new_empty(b, h * d)
        if k_pages.dtype in _PAGE_SUFFIX:
            _check_scales(k_pages, k_scales, v_scales)
            fn = self._page_fns["strata_paged_decode", q.dtype, k_pages.dtype]
        else:
            assert k_pages.dtype == q.dtype and k_scales is None
            fn = self._fns["strata_paged_decode", q.dtype]
        rc = fn(
            q.data_ptr(),
            q.stride(0),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            _ptr(k_scales),
            _ptr(v_scales),
            out.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            b,
            h,
            hkv,
            d,
            block_size,
            block_tables.shape[1],
            scale,
            rotated_keys,
        )
        if rc != 0:
            raise KernelError(f"paged decode kernel rejected its inputs (code {rc})")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of contiguous fp32 [S, V] logits -> int64 [S] (first max wins)."""
        assert logits.dtype == torch.float32 and logits.is_contiguous() and logits.dim() == 2
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
        return out

    def can_pack(self, weight: torch.Tensor) -> bool:
        """True when `pack`/`linear_packed` cover this [N, K] weight (bf16 with AVX512-BF16
        or AVX2, fp32 with AVX-512 or AVX2)."""
        n, k = weight.shape
        fns = self._packed.get(weight.dtype)
        return fns is not None and bool(fns[0](n, k))

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] -> the panel layout `linear_packed` reads (same dtype and number of
        elements), in `out` (contiguous, that many elements) when given."""
        assert self.can_pack(weight) and weight.is_contiguous()
        packed = torch.empty_like(weight).view(-1) if out is None else out.view(-1)
        assert packed.dtype == weight.dtype and packed.is_contiguous()
        assert packed.numel() == weight.numel()
        pack = self._packed[weight.dtype][1]
        pack(weight.data_ptr(), packed.data_ptr(), weight.shape[0], weight.shape[1])
        return packed

    def linear_packed(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """x: [M, K] @ W^T (+ bias) with W packed by `pack`, in x's dtype; fp32 accumulation,
        output [M, out_features] in `out_dtype` (bf16 x: bf16 or fp32; fp32 x: fp32)."""
        assert x.dtype == packed.dtype and x.is_contiguous()
        m, k = x.shape
        assert packed.numel() == out_features * k
        out = x.new_empty(m, out_features, dtype=out_dtype)
        args = [x.data_ptr(), packed.data_ptr(), _ptr(bias), out.data_ptr(), m, out_features, k]
        if x.dtype == torch.bfloat16:
            args.append(out_dtype == torch.float32)
        else:
            assert out_dtype == torch.float32
        if self._packed[x.dtype][2](*args) != 0:
            raise KernelError(f"packed linear rejected [{m}, {k}] x [{out_features}, {k}]")
        return out

    def lora(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        slots: torch.Tensor,
        y: torch.Tensor,
        part_ends: Sequence[int] = (),
    ) -> None:
        """y [T, N] += B[s] A[s] x[t] for each token whose slot s = slots[t] (int32) is not 0
        (csrc/lora.h); bf16 x [T, K], a [S, R, K], B transposed in pairs of rows bt
        [S, R / 2, N, 2] (`pair_rows`). `part_ends`: where the columns of each module of a
        fused projection end (default: one module); each module has an even number of rows.
        Mutates y."""
        ends, h = _lora_checks(x, a, bt, slots, y, part_ends)
        rc = self._lora(
            x.data_ptr(),
            x.stride(0),
            a.data_ptr(),
            bt.data_ptr(),
            slots.data_ptr(),
            y.data_ptr(),
            y.stride(0),
            x.shape[0],
            x.shape[1],
            y.shape[1],
            a.shape[1],
            ends,
            len(ends),
            h.data_ptr(),
        )
        if rc != 0:
            raise KernelError(f"LoRA update failed ({rc}): out of memory")

    def linear_lora(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | QuantWeight,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        bt: torch.Tensor,
        slots: torch.Tensor,
        part_ends: Sequence[int] = (),
    ) -> torch.Tensor:
        """One projection of the decoder layer, as the layer runs it (csrc/layer.h): the
        product of bf16 x with packed bf16 weights (`linear_packed`) or quantized ones
        (`quant.linear`), to bf16, and `lora`'s update of its output: [T, N]."""
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        m, k = x.shape
        n = bt.shape[2]
        if isinstance(weight, QuantWeight):
            assert (weight.out_features, weight.in_features) == (n, k)
            fmt, w = weight.format.code, weight.rows
        else:
            assert weight.dtype == torch.bfloat16 and weight.numel() == n * k
            fmt, w = 0, weight
        y = x.new_empty(m, n)
        ends, h = _lora_checks(x, a, bt, slots, y, part_ends)
        rc = self._linear_lora(
            fmt,
            x.data_ptr(),
            w.data_ptr(),
            _ptr(bias),
            y.data_ptr(),
            m,
            n,
            k,
            a.data_ptr(),
            bt.data_ptr(),
            slots.data_ptr(),
            a.shape[1],
            ends,
            len(ends),
            h.data_ptr(),
        )
        if rc != 0:
            raise KernelError(f"linear with LoRA update failed ({rc})")
        return y

    def decoder_layer(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        first: bool,
        w: LayerWeights,
        positions: torch.Tensor,
        pages: LayerPages,
        lora: LayerLoRA | None = None,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One whole bf16 decoder layer (csrc/layer.h) -> the layer output [T, H].

        Mutates `residual` (initialised from `x` when `first`) and writes the step's K/V into
        the pages; bit-identical to running the layer's native modules one by one. With
        `lora` and `lora_slots` (int32, each token's adapter slot), every projection adds
        its tokens' adapter updates.
        """
        t, hidden = x.shape
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and residual.is_contiguous()
        if pages.k.dtype in _PAGE_SUFFIX:
            _check_scales(pages.k, pages.k_scales, pages.v_scales)
        else:
            assert pages.k.dtype == x.dtype and pages.k_scales is None
        ws = _workspace(x, w)
        out = torch.empty_like(x)
        lora_args, _scratch = _lora_args(lora, lora_slots, t)
        rc = self._layer(
            x.data_ptr(),
            residual.data_ptr(),
            first,
            w.in_norm.data_ptr(),
            w.post_norm.data_ptr(),
            w.eps,
            w.qkv.data_ptr(),
            _ptr(w.qkv_bias),
            w.o.data_ptr(),
            w.gate_up.data_ptr(),
            w.down.data_ptr(),
            w.format_array,
            positions.data_ptr(),
            w.cos.data_ptr(),
            w.sin.data_ptr(),
            pages.k.data_ptr(),
            pages.v.data_ptr(),
            _ptr(pages.k_scales),
            _ptr(pages.v_scales),
            pages.rotated_keys,
            pages.slots.data_ptr(),
            pages.block_tables.data_ptr(),
            pages.seq_lens.data_ptr(),
            pages.block_tables.shape[1],
            t,
            hidden,
            w.num_heads,
            w.num_kv_heads,
            w.head_dim,
            w.intermediate,
            pages.k.shape[1],
            pages.scale,
            ws.data_ptr(),
            out.data_ptr(),
            *lora_args,
        )
        if rc != 0:
            raise KernelError(f"decoder layer kernel failed (code {rc})")
        return out

    def decoder_stack(
        self,
        x: torch.Tensor,
        stack: StackWeights,
        positions: torch.Tensor,
        pages: LayerPages,
        pool: StackPages,
        lora: StackLoRA | None = None,
        lora_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer of `stack` in one call (csrc/layer.h) -> (the last layer's output,
        the residual); bit-identical to `decoder_layer` layer by layer. `pages` gives this
        step's slots, block tables and lengths, `pool` every layer's pages; `lora` and
        `lora_slots` as for `decoder_layer`, for every layer."""
        t, hidden = x.shape
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        w = stack.layers[0]
        ws = _workspace(x, w)
        residual, out0, out1 = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        lora_args, _scratch = _lora_args(lora, lora_slots, t)
        rc = self._stack(
            len(stack.layers),
            x.data_ptr(),
            residual.data_ptr(),
            stack.in_norm,
            stack.post_norm,
            w.eps,
            stack.qkv,
            stack.qkv_bias,
            stack.o,
            stack.gate_up,
            stack.down,
            stack.formats,
            positions.data_ptr(),
            w.cos.data_ptr(),
            w.sin.data_ptr(),
            pool.k,
            pool.v,
            pool.k_scales,
            pool.v_scales,
            pages.rotated_keys,
            pages.slots.data_ptr(),
            pages.block_tables.data_ptr(),
            pages.seq_lens.data_ptr(),
            pages.block_tables.shape[1],
            t,
            hidden,
            w.num_heads,
            w.num_kv_heads,
            w.head_dim,
            w.intermediate,
            pages.k.shape[1],
            pages.scale,
            ws.data_ptr(),
            out0.data_ptr(),
            out1.data_ptr(),
            *lora_args,
        )
        if rc != 0:
            raise KernelError(f"decoder stack kernel failed (code {rc})")
        return (out0 if len(stack.layers) % 2 else out1), residual


class LayerLoRA:
    """One layer's adapter slots as `decoder_layer` reads them: A [slots, R, in] and B
    transposed in pairs of rows [slots, R / 2, out, 2] (`pair_rows`) of qkv, o, gate_up and
    down, as pointer arrays for the C side (the tensors are kept alive here)."""

    def __init__(
        self,
        a: Sequence[torch.Tensor],
        b: Sequence[torch.Tensor],
        part_ends: Sequence[Sequence[int]],
    ) -> None:
        """`part_ends`: per projection, where each of its modules' output columns end."""
        assert len(a) == len(b) == len(part_ends) == 4
        assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (*a, *b))
        assert all(1 <= len(e) <= 3 for e in part_ends)
        self.tensors = (tuple(a), tuple(b))
        self.rows = tuple(t.shape[1] for t in a)
        self.max_rows = max(self.rows)
        self.a_ptrs = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in a))
        self.b_ptrs = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in b))
        self.rows_arr = (ctypes.c_int64 * 4)(*self.rows)
        flat = [e[i] if i < len(e) else e[-1] for e in part_ends for i in range(3)]
        self.part_ends = (ctypes.c_int64 * 12)(*flat)
        self.parts = (ctypes.c_int64 * 4)(*(len(e) for e in part_ends))


@dataclass(frozen=True)
class LayerWeights:
    """A bf16 decoder layer's weights and shapes, as `decoder_layer` reads them: each of
    qkv, o, gate_up and down packed by `pack` (format 0) or a quantized weight's rows
    (`formats`: its QuantFormat code, csrc/quant.h)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    formats: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def format_array(self) -> Any:
        return (ctypes.c_int64 * 4)(*self.formats)


@dataclass(frozen=True)
class LayerPages:
    """Where one layer's attention reads and writes this step (from the attention context)."""

    k: torch.Tensor  # [num_blocks, block, Hkv, D]
    v: torch.Tensor
    slots: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [T, max_blocks] int64
    seq_lens: torch.Tensor  # [T] int32
    scale: float
    k_scales: torch.Tensor | None = None  # [num_blocks, block, Hkv] float32 for FP8 pages
    v_scales: torch.Tensor | None = None
    rotated_keys: bool = False  # FP8 keys stored Hadamard-rotated


def _workspace(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """Scratch for the layer kernels over x's tokens (csrc/layer.h)."""
    q_size = w.num_heads * w.head_dim
    qkv_size = q_size + 2 * w.num_kv_heads * w.head_dim
    return x.new_empty(x.shape[0] * (x.shape[1] + qkv_size + q_size + 3 * w.intermediate))


def pair_rows(bt: torch.Tensor) -> torch.Tensor:
    """B transposed [..., R, N] (R even) -> the layout the LoRA kernels read, [..., R / 2, N, 2],
    element (q, n, 0) being row 2q + 1 and (q, n, 1) row 2q (csrc/lora.h)."""
    assert bt.shape[-2] % 2 == 0
    return bt.unflatten(-2, (bt.shape[-2] // 2, 2)).flip(-2).transpose(-2, -1).contiguous()


def _lora_checks(
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    slots: torch.Tensor,
    y: torch.Tensor,
    part_ends: Sequence[int],
) -> tuple[Any, torch.Tensor]:
    """What the LoRA kernels assume of their tensors; returns the part ends as a C array and
    the kernels' scratch for h."""
    t = x.shape[0]
    rows, n = a.shape[1], bt.shape[2]
    assert x.dtype == a.dtype == bt.dtype == y.dtype == torch.bfloat16
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and bt.is_contiguous()
    assert bt.shape[1] * 2 == rows and bt.shape[3] == 2, "B^T in pairs of rows (pair_rows)"
    assert slots.dtype == torch.int32 and slots.shape == (t,) and y.shape == (t, n)
    ends = list(part_ends) or [n]
    assert ends[-1] == n and rows % (2 * len(ends)) == 0, "an even number of rows per part"
    return (ctypes.c_int64 * len(ends))(*ends), torch.empty(t * rows, dtype=torch.float32)


def _lora_args(
    lora: LayerLoRA | StackLoRA | None, slots: torch.Tensor | None, tokens: int
) -> tuple[list[int | None], torch.Tensor | None]:
    """The layer kernels' seven LoRA arguments (all NULL without adapters), and the scratch
    tensor they point into, which the caller keeps alive through the call."""
    if lora is None or slots is None:
        return [None] * 7, None
    assert slots.dtype == torch.int32 and slots.shape == (tokens,)
    scratch = torch.empty(tokens * lora.max_rows, dtype=torch.float32)
    args: list[int | None] = [
        ctypes.addressof(lora.a_ptrs),
        ctypes.addressof(lora.b_ptrs),
        ctypes.addressof(lora.rows_arr),
        ctypes.addressof(lora.part_ends),
        ctypes.addressof(lora.parts),
        slots.data_ptr(),
        scratch.data_ptr(),
    ]
    return args, scratch


def _pointers(tensors: Sequence[torch.Tensor | None]) -> Any:
    """A C array of the tensors' data pointers (NULL for None)."""
    return (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


class StackWeights:
    """Every layer's `LayerWeights` as the pointer arrays `decoder_stack` reads (the
    tensors stay alive through `layers`)."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        assert layers
        self.layers = tuple(layers)
        self.in_norm = _pointers([w.in_norm for w in layers])
        self.post_norm = _pointers([w.post_norm for w in layers])
        self.qkv = _pointers([w.qkv for w in layers])
        has_bias = [w.qkv_bias is not None for w in layers]
        assert all(has_bias) or not any(has_bias), "qkv bias on some layers only"
        self.qkv_bias = _pointers([w.qkv_bias for w in layers]) if has_bias[0] else None
        self.o = _pointers([w.o for w in layers])
        self.gate_up = _pointers([w.gate_up for w in layers])
        self.down = _pointers([w.down for w in layers])
        self.formats = (ctypes.c_int64 * (4 * len(layers)))(*(f for w in layers for f in w.formats))


class StackLoRA:
    """Every layer's `LayerLoRA`, concatenated as `decoder_stack` reads them."""

    def __init__(self, layers: Sequence[LayerLoRA]) -> None:
        self.layers = tuple(layers)  # keeps their arrays (and tensors) alive
        n = len(layers)

        def cat(kind: Any, size: int, name: str) -> Any:
            return (kind * (size * n))(*(v for layer in layers for v in getattr(layer, name)))

        self.a_ptrs = cat(ctypes.c_void_p, 4, "a_ptrs")
        self.b_ptrs = cat(ctypes.c_void_p, 4, "b_ptrs")
        self.rows_arr = cat(ctypes.c_int64, 4, "rows_arr")
        self.part_ends = cat(ctypes.c_int64, 12, "part_ends")
        self.parts = cat(ctypes.c_int64, 4, "parts")
        self.max_rows = max(layer.max_rows for layer in layers)


class StackPages:
    """Every layer's K/V pages (and FP8 scales) as pointer arrays for `decoder_stack`."""

    def __init__(self, layers: Sequence[LayerPages]) -> None:
        first = layers[0]
        fp8 = first.k.dtype in _PAGE_SUFFIX
        for pages in layers:
            if fp8:
                _check_scales(pages.k, pages.k_scales, pages.v_scales)
            else:
                assert pages.k.dtype == torch.bfloat16 and pages.k_scales is None
        self.tensors = tuple(layers)
        self.k = _pointers([p.k for p in layers])
        self.v = _pointers([p.v for p in layers])
        self.k_scales = _pointers([p.k_scales for p in layers]) if fp8 else None
        self.v_scales = _pointers([p.v_scales for p in layers]) if fp8 else None


def _check_scales(
    pages: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None
) -> None:
    assert k_scales is not None and v_scales is not None, "FP8 pages need their scales"
    for scales in (k_scales, v_scales):
        assert scales.dtype == torch.float32 and scales.is_contiguous()
        assert scales.shape == pages.shape[:3]


def kernel_dir(cache_dir: str | None) -> Path:
    """Where the built kernels are kept: `<cache_dir>/kernels`, or a directory under the
    system's temporary directory when no cache directory is configured."""
    base = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "strata-cache"
    return base / "kernels"


def isa_build(isa: str) -> str:
    """The build (`load_cpu_kernels`' arch) of a resolved instruction level."""
    return _ISA_BUILD[isa]


def load_cpu_kernels(cache_dir: str | None, arch: str = "native") -> CpuKernels | None:
    """Build (once) and load the kernels; None when this machine cannot build them.

    `arch="avx2"` builds the AVX2 paths (no AVX-512) and `arch="portable"` builds without
    CPU-specific instructions (the scalar fallbacks).
    """
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or platform.system() != "Linux":
        log.info("no C compiler found; the engine uses torch ops only")
        return None
    try:
        path = _build(kernel_dir(cache_dir), compiler, arch)
        return CpuKernels(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()
        log.warning(
            "native CPU kernels unavailable (%s); using torch ops",
            detail.splitlines()[-1] if detail else exc,
        )
        return None
