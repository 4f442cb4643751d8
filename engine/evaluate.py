"""Model-quality measurements on the engine's own forward path (paged KV, chosen KV dtype).

`perplexity` scores a token stream in windows, each fed through a private paged KV pool in
chunks, so every chunk after the first attends to the cached (possibly FP8) K/V of the
earlier ones, exactly as served requests do. `greedy_agreement` compares two sets of greedy
continuations token by token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.paged import PagedAttention, SeqSlice
from engine.attention.triton_backend import TritonPagedAttention
from engine.core import EngineCore
from kvstore.device_pool import DeviceKVPool


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    num_tokens: int  # tokens scored


@torch.inference_mode()
def perplexity(
    core: EngineCore, token_ids: Sequence[int], *, window: int = 2048, chunk: int = 512
) -> Perplexity:
    """exp(mean NLL) of `token_ids[1:]`, each token conditioned on up to `window` previous
    tokens (non-overlapping windows), with the core's model, KV dtype and kernels."""
    if len(token_ids) < 2 or window < 1 or chunk < 1:
        raise ValueError("need at least 2 tokens and a positive window and chunk")
    runner = core.runner
    spec = core.pool.spec
    table = list(range(-(-window // spec.block_size)))
    pool = DeviceKVPool(spec, len(table), core.device)  # private: the core's cache is untouched
    attn: PagedAttention | TritonPagedAttention
    if isinstance(runner.attn, TritonPagedAttention):
        attn = TritonPagedAttention(pool, runner.attn.num_heads)
    else:
        attn = PagedAttention(pool, runner.attn.num_heads, kernels=runner.attn.kernels)
    model = runner.model
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        seq = list(token_ids[start : start + window + 1])
        for c0 in range(0, len(seq) - 1, chunk):
            ids = seq[c0 : min(c0 + chunk, len(seq) - 1)]
            ctx = attn.build_context([SeqSlice(len(ids), c0, table)])
            hidden = model(
                torch.tensor(ids, device=core.device),
                torch.arange(c0, c0 + len(ids), device=core.device),
                attn,
                ctx,
            )
            logits = model.compute_logits(hidden)
            targets = torch.tensor(seq[c0 + 1 : c0 + 1 + len(ids)], device=core.device)
            nll += F.cross_entropy(logits.float(), targets, reduction="sum").item()
            count += len(ids)
    return Perplexity(math.exp(nll / count), count)


@dataclass(frozen=True)
class Agreement:
    token_rate: float  # positions where both produced the same token / positions compared
    prefix_rate: float  # mean length of the common prefix / mean length compared
    identical: int  # sequences that match entirely
    total: int


def greedy_agreement(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> Agreement:
    """How closely `candidate` continuations follow `reference` ones, pair by pair."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("need the same, non-zero number of sequences on both sides")
    same = compared = prefix = identical = 0
    for ref, cand in zip(reference, candidate, strict=True):
        n = min(len(ref), len(cand))
        same += sum(a == b for a, b in zip(ref[:n], cand[:n], strict=True))
        compared += max(len(ref), len(cand))
        common = next((i for i in range(n) if ref[i] != cand[i]), n)
        prefix += common
        identical += list(ref) == list(cand)
    return Agreement(same / compared, prefix / compared, identical, len(reference))
