"""Types shared by every KV tier: what a page holds and how big it is."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one KV page: `block_size` tokens of K and V for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        assert self.num_layers > 0
        assert self.num_kv_heads > 0
        assert self.head_dim > 0
        assert self.block_size > 0

    @property
    def bytes_per_token(self) -> int:
        """K and V for one token across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block
