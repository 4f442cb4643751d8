"""The device tier: one preallocated tensor holding every KV page of every layer."""

from __future__ import annotations

import torch

from kvstore.base import KVCacheSpec
from kvstore.fp8 import SCALE_DTYPE


class DeviceKVPool:
    """`num_blocks` pages allocated once on `device`, zero-filled.

    Layout per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`; FP8
    pools add K and V scales, each `[num_blocks, block_size, num_kv_heads]` float32.
    Zero-filling matters: masked-out slots of a gathered page must hold finite values.
    The pool only stores bytes; which block belongs to whom is the block manager's business.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        assert num_blocks > 0
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads)
        # kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = torch.zeros(*shape, spec.head_dim, dtype=spec.dtype, device=device)
        self.scales = (
            torch.zeros(shape, dtype=SCALE_DTYPE, device=device) if spec.quantized else None
        )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) page tensors of one layer, each [num_blocks, block_size, kv_heads, D]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) scales of one layer, each [num_blocks, block_size, kv_heads]; None unless
        the pool is FP8."""
        if self.scales is None:
            return None
        return self.scales[layer_idx, 0], self.scales[layer_idx, 1]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales
