"""Token bitmasks applied to logits: one vectorized op for every constrained row of a step,
on whatever device the logits are (the masks are filled on the host, one int32 word per 32
vocabulary entries, and copied over once per step)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch


def new_bitmask(num_rows: int, num_words: int) -> torch.Tensor:
    """[num_rows, num_words] int32 on the host, every token refused."""
    return torch.zeros(num_rows, num_words, dtype=torch.int32)


@lru_cache(maxsize=8)
def _refused_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: for each byte value, which of its bits (lowest first) are clear."""
    values = torch.arange(256, dtype=torch.int32)
    return (((values[:, None] >> torch.arange(8, dtype=torch.int32)) & 1) == 0).to(device)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """In place: -inf on every token of `logits[rows[i]]` (of row i when `rows` is None) that
    `bitmask[i]` does not allow. logits: [S, V]; rows: [C] long; bitmask: [C, W] int32 on the
    logits' device, token t at bit t % 32 of word t // 32."""
    vocab = logits.shape[1]
    refused = _unpack_refused(bitmask)  # [C, 32 W]
    if refused.shape[1] < vocab:  # ids past the mask's words are never allowed
        refused = torch.nn.functional.pad(refused, (0, vocab - refused.shape[1]), value=True)
    refused = refused[:, :vocab]  # [C, V]
    if rows is None:
        logits.masked_fill_(refused, float("-inf"))
        return
    constrained = logits.index_select(0, rows)  # [C, V]
    constrained.masked_fill_(refused, float("-inf"))
    logits.index_copy_(0, rows, constrained)


def _unpack_refused(bitmask: torch.Tensor) -> torch.Tensor:
    """[C, W] int32 -> [C, 32 W] bool, True where a token's bit is clear. The words' bytes in
    memory order (little-endian) hold token t at bit t % 8 of byte t // 8."""
    if bitmask.device.type == "cpu":  # numpy unpacks bits several times faster on the host
        data = bitmask.contiguous().numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(data, axis=1, bitorder="little") == 0)
    return unpack_refused_on_device(bitmask)


def unpack_refused_on_device(bitmask: torch.Tensor) -> torch.Tensor:
    """`_unpack_refused` in torch ops, for a bitmask on an accelerator (any device works)."""
    data = bitmask.contiguous().view(torch.uint8).flatten().int()  # [C * 4 W]
    refused = _refused_bits(bitmask.device).index_select(0, data)  # [C * 4 W, 8]
    return refused.view(bitmask.shape[0], -1)
