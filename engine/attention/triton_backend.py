"""Paged attention through the Triton kernels (engine/kernels/triton_attention.py), behind the
same interface as `PagedAttention` (`build_context` per step, `forward` per layer), and the
rules for loading the Triton kernels (compiled on CUDA, interpreted elsewhere).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.paged import PoolAttention, SeqSlice, padded_tables, slot_indices
from engine.device import to_device
from kvstore.device_pool import DeviceKVPool

log = logging.getLogger(__name__)

_MAX_SPLITS = 16
_TILE_ROWS = 64  # query rows (tokens x heads of a KV head's group) per prefill program


class TritonUnavailableError(RuntimeError):
    """Triton cannot run the kernels here (not installed, or loaded for another device)."""


def load_triton_kernels(device: torch.device, name: str = "triton_attention") -> ModuleType:
    """A kernel module of engine/kernels (`triton_attention`, `triton_fused`, `triton_gemv`,
    `triton_fp8_linear`, ...): compiled on CUDA, under the interpreter elsewhere.

    Triton picks its mode once, when first imported (engine/__init__.py picks the
    interpreter on machines with no GPU driver); a process in the wrong mode raises.
    """
    try:
        import triton.language.standard  # noqa: PLC0415 (optional: absent where unsupported)
        from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    except ImportError as exc:
        raise TritonUnavailableError(f"Triton is not installed ({exc})") from exc
    interpreted = isinstance(triton.language.standard.zeros, InterpretedFunction)
    if interpreted != (device.type != "cuda"):
        mode = "interpreter" if interpreted else "compiler"
        raise TritonUnavailableError(
            f"Triton was loaded for its {mode} in this process, which cannot run kernels on "
            f"{device.type}; start Python with TRITON_INTERPRET="
            f"{'0' if interpreted else '1'}"
        )
    return importlib.import_module(f"engine.kernels.{name}")


def use_pdl(enabled: bool, triton: bool, device: torch.device) -> bool:
    """Whether an engine's Triton kernels launch to start early: asked for (`EngineConfig.pdl`),
    on the Triton kernels, and supported on `device`. The one rule for the model's kernels
    (engine/factory.py) and attention's (engine/core.py)."""
    return enabled and triton and pdl_supported(device)


def pdl_supported(device: torch.device) -> bool:
    """Whether the Triton kernels can launch to start early on `device` (programmatic
    dependent launch: a CUDA device of compute capability 9.0 or more, and a Triton that
    has it; engine/kernels/triton_pdl.py)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return bool(load_triton_kernels(device, "triton_pdl").AVAILABLE)


@dataclass
class TritonContext:
    slot_mapping: torch.Tensor  # [T] int64; < 0 for padding rows (skipped)
    block_table: torch.Tensor  # [S, max_blocks] int32, decode sequences first
    num_decode: int
    seq_lens: torch.Tensor | None  # [num_decode] int32: each decode sequence's length
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    num_splits: int  # of the decode rows' contexts
    tile_splits: int = 1  # of the prefill tiles' contexts


class TritonPagedAttention(PoolAttention):
    """Attention over a `DeviceKVPool` with the Triton kernels."""

    def __init__(
        self,
        pool: DeviceKVPool,
        num_heads: int,
        scale: float | None = None,
        *,
        num_splits: int | None = None,
        block_n: int | None = None,
        pdl: bool = False,
    ) -> None:
        """`num_splits`: programs per (decode sequence, KV head); None picks by occupancy.
        `block_n`: KV tokens per inner iteration (at least 16); None picks by page dtype.
        `pdl`: the kernels launch to start early (engine/kernels/triton_pdl.py)."""
        super().__init__(pool, num_heads, scale)
        self.pdl = pdl
        self.kernels = load_triton_kernels(pool.device)
        self.fixed_splits = num_splits
        self.block_n = block_n or 64
        # FP8 decode reads half the bytes per token: 128 tokens per iteration keep as many in
        # flight (+29% at batch 64 x 2,048 tokens of Llama-3-8B heads on an H100)
        self.decode_block_n = block_n or (128 if pool.spec.dtype == torch.float8_e4m3fn else 64)
        group = max(1, num_heads // self.num_kv_heads)
        self.tokens_per_tile = max(1, _TILE_ROWS // (1 << (group - 1).bit_length()))
        device = pool.device
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )

    def decode_splits(self, num_seqs: int, max_len: int) -> int:
        """Programs per (sequence, KV head): enough for about two waves over the GPU's SMs,
        never more than the longest context has KV tiles; a power of two."""
        return self._splits(num_seqs, max_len, self.decode_block_n)

    def tile_splits(self, num_tiles: int, max_len: int) -> int:
        """`decode_splits` for prefill tiles: a few tiles over a long context (a drafted
        step's tokens, a short chunk after a long prefix) split it; a long chunk does not."""
        return self._splits(num_tiles, max_len, self.block_n)

    def _splits(self, num_tiles: int, max_len: int, block_n: int) -> int:
        if self.fixed_splits is not None:
            return self.fixed_splits
        want = -(-2 * self.num_sms // max(1, num_tiles * self.num_kv_heads))
        tiles = -(-max_len // block_n)
        splits = 1
        while splits < min(want, tiles, _MAX_SPLITS):
            splits *= 2
        return splits

    def build_context(self, seqs: list[SeqSlice]) -> TritonContext:
        """Metadata for one step; `seqs` lists every `query_len == 1` sequence first."""
        device = self.pool.device
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].query_len == 1:
            num_decode += 1
        assert all(s.query_len > 1 for s in seqs[num_decode:]), "decodes must come first"
        table = padded_tables(seqs, torch.int32)
        seq_lens = None
        splits = 1
        if num_decode:
            lens = [s.context_len + 1 for s in seqs[:num_decode]]
            seq_lens = to_device(torch.tensor(lens, dtype=torch.int32), device)
            splits = self.decode_splits(num_decode, max(lens))
        tiles = None
        tile_splits = 1
        if num_decode < len(seqs):
            rows: list[tuple[int, int, int, int]] = []
            row = num_decode
            for i, s in enumerate(seqs[num_decode:], start=num_decode):
                for start in range(0, s.query_len, self.tokens_per_tile):
                    length = min(self.tokens_per_tile, s.query_len - start)
                    rows.append((i, row + start, length, s.context_len + start))
                row += s.query_len
            cols = to_device(torch.tensor(rows, dtype=torch.int32).t().contiguous(), device)
            tiles = (cols[0], cols[1], cols[2], cols[3])
            longest = max(s.context_len + s.query_len for s in seqs[num_decode:])
            tile_splits = self.tile_splits(len(rows), longest)
        slots = torch.tensor(slot_indices(seqs, self.block_size), dtype=torch.long)
        return TritonContext(
            slot_mapping=to_device(slots, device),
            block_table=to_device(table, device),
            num_decode=num_decode,
            seq_lens=seq_lens,
            tiles=tiles,
            num_splits=splits,
            tile_splits=tile_splits,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: TritonContext,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]; writes k/v into the pool first."""
        k_pages, v_pages = self.pool.layer(layer_idx)
        k_scales, v_scales = self.pool.layer_scales(layer_idx) or (None, None)
        kern = self.kernels
        kern.kv_write(
            k,
            v,
            k_pages,
            v_pages,
            ctx.slot_mapping,
            k_scales,
            v_scales,
            rotate_keys=self.rotate_keys,
            pdl=self.pdl,
        )
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        common = {
            "k_scales": k_scales,
            "v_scales": v_scales,
            "rotated_keys": self.rotate_keys,
            "pdl": self.pdl,
        }
        if ctx.seq_lens is not None:
            nd = ctx.num_decode
            kern.paged_attention(
                q[:nd],
                k_pages,
                v_pages,
                out[:nd],
                ctx.block_table,
                self.scale,
                seq_lens=ctx.seq_lens,
                num_splits=ctx.num_splits,
                block_n=self.decode_block_n,
                **common,
            )
        if ctx.tiles is not None:
            kern.paged_attention(
                q,
                k_pages,
                v_pages,
                out,
                ctx.block_table,
                self.scale,
                tiles=ctx.tiles,
                tokens_per_tile=self.tokens_per_tile,
                block_n=self.block_n,
                num_splits=ctx.tile_splits,
                first_row=ctx.num_decode,
                **common,
            )
        return out
