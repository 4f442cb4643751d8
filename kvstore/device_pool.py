"""The device tier: one preallocated tensor holding every KV page of every layer."""

from __future__ import annotations

import torch

from kvstore.base import KVCacheSpec


class DeviceKVPool:
    """`num_blocks` pages allocated once on `device`, zero-filled.

    Layout per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`.
    Zero-filling matters: masked-out slots of a gathered page must hold finite values.
    The pool only stores bytes; which block belongs to whom is the block manager's business.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        assert num_blocks > 0
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        # kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = torch.zeros(
            spec.num_layers,
            2,
            num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=spec.dtype,
            device=device,
        )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) page tensors of one layer, each [num_blocks, block_size, kv_heads, D]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
