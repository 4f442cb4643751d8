"""Token bitmasks applied to logits: one vectorized op for every constrained row of a step,
on whatever device the logits are (the masks are filled on the host, one int32 word per 32
vocabulary entries, and copied over once per step)."""

from __future__ import annotations

import torch


def new_bitmask(num_rows: int, num_words: int) -> torch.Tensor:
    """[num_rows, num_words] int32 on the host, every token refused."""
    return torch.zeros(num_rows, num_words, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf on every token of `logits[rows[i]]` that `bitmask[i]` does not allow.
    logits: [S, V]; rows: [C] long; bitmask: [C, W] int32, on the logits' device."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [C, 32 W]
    if allowed.shape[1] < vocab:  # ids past the mask's words are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    constrained = logits.index_select(0, rows)  # [C, V]
    constrained.masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, rows, constrained)
