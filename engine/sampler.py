"""Batched sampling: every request's own parameters (penalties, temperature, top-k, top-p,
min-p, seed, logprobs, the grammar of a response format) applied to the whole batch at once,
one uniform number per sampled row. The design is in docs/design/scheduler.md; grammars in
docs/structured-output.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device import to_device
from engine.request import Request
from engine.structured.backend import mask_words
from engine.structured.bitmask import apply_bitmask, new_bitmask


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step; rows follow the order of sampled requests."""

    temperature: torch.Tensor  # [S] fp32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [S] long, vocab_size where disabled
    top_k_max: int  # the largest k among rows (known on the host: no device sync)
    top_p: torch.Tensor | None  # [S] fp32
    min_p: torch.Tensor | None  # [S] fp32
    generators: list[torch.Generator | None]
    frequency_penalty: torch.Tensor | None  # [S, 1]
    presence_penalty: torch.Tensor | None  # [S, 1]
    repetition_penalty: torch.Tensor | None  # [S, 1]
    output_ids: torch.Tensor | None  # [S, max_out] padded with vocab_size
    prompt_ids: torch.Tensor | None  # [S, max_prompt] padded with vocab_size
    max_num_logprobs: int | None
    # logit_bias and min_tokens, as sparse (row, token id, value) triples added to the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # rows with a response format (None: every row), and the tokens each may take next
    mask_rows: torch.Tensor | None = None  # [C] long
    bitmask: torch.Tensor | None = None  # [C, ceil(V / 32)] int32, one bit per token


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long
    logprobs: torch.Tensor | None  # [S] fp32, the sampled token's logprob
    top_ids: torch.Tensor | None  # [S, n] long
    top_logprobs: torch.Tensor | None  # [S, n] fp32


def _pad(rows: list[list[int]], fill: int, device: torch.device) -> torch.Tensor:
    width = max(1, *(len(r) for r in rows))
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return to_device(out, device)


def build_sampling_batch(
    requests: list[Request],
    vocab_size: int,
    device: torch.device,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplingBatch:
    """`eos_token_ids`: what min_tokens holds back (with each request's stop token ids).
    Fills the token masks of requests with a response format (their matchers may mark
    themselves stuck: no token can continue)."""
    params = [r.params for r in requests]

    def col(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)

    temperature = col([p.temperature for p in params])
    all_greedy = all(p.is_greedy for p in params)
    sampled = [p for p in params if not p.is_greedy]
    top_k = top_p = min_p = None
    top_k_max = 0
    if any(p.top_k is not None for p in sampled):
        ks = [min(p.top_k or vocab_size, vocab_size) for p in params]
        top_k, top_k_max = to_device(torch.tensor(ks), device), max(ks)
    if any(p.top_p < 1.0 for p in sampled):
        top_p = col([p.top_p for p in params])
    if any(p.min_p > 0.0 for p in sampled):
        min_p = col([p.min_p for p in params])

    freq = pres = rep = out_ids = prompt_ids = None
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        freq = col([p.frequency_penalty for p in params])[:, None]
        pres = col([p.presence_penalty for p in params])[:, None]
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = col([p.repetition_penalty for p in params])[:, None]
        prompt_ids = _pad([r.prompt_token_ids for r in requests], vocab_size, device)
    if freq is not None or rep is not None:
        out_ids = _pad([r.output_token_ids for r in requests], vocab_size, device)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    bias = _sparse_bias(requests, eos_token_ids, device)
    mask_rows, bitmask = _token_masks(requests, vocab_size, device)
    return SamplingBatch(
        temperature=temperature,
        all_greedy=all_greedy,
        top_k=top_k,
        top_k_max=top_k_max,
        top_p=top_p,
        min_p=min_p,
        generators=[r.generator for r in requests],
        frequency_penalty=freq,
        presence_penalty=pres,
        repetition_penalty=rep,
        output_ids=out_ids,
        prompt_ids=prompt_ids,
        max_num_logprobs=max(wanted) if wanted else None,
        bias=bias,
        mask_rows=mask_rows,
        bitmask=bitmask,
    )


def _token_masks(
    requests: list[Request], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows with a grammar and their masks, filled on the host (each matcher's own
    work), then copied to the device in one transfer."""
    rows = [row for row, r in enumerate(requests) if r.matcher is not None]
    if not rows:
        return None, None
    bitmask = new_bitmask(len(rows), mask_words(vocab_size))
    for i, row in enumerate(rows):
        matcher = requests[row].matcher
        assert matcher is not None
        matcher.fill_mask(bitmask, i)
    if rows == list(range(len(requests))):  # every row: masked in place
        return None, to_device(bitmask, device)
    rows_t = torch.tensor(rows, dtype=torch.long)
    return to_device(rows_t, device), to_device(bitmask, device)


def _sparse_bias(
    requests: list[Request], eos_token_ids: frozenset[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each row's logit_bias, and -inf on the tokens that would end it before min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for row, r in enumerate(requests):
        p = r.params
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            cols.extend(p.logit_bias)
            vals.extend(p.logit_bias.values())
        if r.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            rows.extend([row] * len(banned))
            cols.extend(banned)
            vals.extend([float("-inf")] * len(banned))
    if not rows:
        return None
    return (
        to_device(torch.tensor(rows, dtype=torch.long), device),
        to_device(torch.tensor(cols, dtype=torch.long), device),
        to_device(torch.tensor(vals, dtype=torch.float32), device),
    )


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids: [S, N] padded with vocab_size -> counts [S, vocab_size]."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place. Logit bias (and min_tokens' bans); OpenAI frequency/presence over generated
    tokens; HF-style repetition penalty over prompt and generated tokens."""
    vocab = logits.shape[1]
    if batch.bias is not None:
        logits.index_put_(batch.bias[:2], batch.bias[2], accumulate=True)
    if batch.output_ids is None:
        return
    out_counts = _token_counts(batch.output_ids, vocab)
    if batch.repetition_penalty is not None:
        assert batch.prompt_ids is not None
        seen = (out_counts > 0) | (_token_counts(batch.prompt_ids, vocab) > 0)
        rep = batch.repetition_penalty.expand_as(logits)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    if batch.frequency_penalty is not None:
        assert batch.presence_penalty is not None
        logits.sub_(batch.frequency_penalty * out_counts)
        logits.sub_(batch.presence_penalty * (out_counts > 0).float())


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> None:
    k_max = min(logits.shape[1], k_max)
    kth = torch.topk(logits, k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1)[:, None])
    logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    # every row (rows at top_p = 1 drop nothing): selecting rows would need a device sync
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # drop a token once the mass strictly before it already reaches top_p
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop_sorted &= (top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits.masked_fill_(drop, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    logits.masked_fill_(probs < threshold, float("-inf"))


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SamplerOutput:
    """logits: [S, V] fp32 (mutated in place) -> one token per row.

    Rows without a seed draw their noise from `generator` (the engine's own stream).
    `argmax` replaces torch's row-wise argmax for the greedy path (a native kernel on CPU).
    """
    raw_logprobs = None
    if batch.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    apply_penalties(logits, batch)
    if batch.bitmask is not None:
        apply_bitmask(logits, batch.mask_rows, batch.bitmask)
    greedy = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    if batch.all_greedy:
        token_ids = greedy
    else:
        temp = batch.temperature
        logits.div_(torch.where(temp > 0, temp, torch.ones_like(temp))[:, None])
        if batch.top_k is not None:
            _apply_top_k(logits, batch.top_k, batch.top_k_max)
        if batch.top_p is not None:
            _apply_top_p(logits, batch.top_p)
        if batch.min_p is not None:
            _apply_min_p(logits, batch.min_p)
        probs = logits.softmax(dim=-1)  # [S, V]
        u = torch.rand(probs.shape[0], device=probs.device, generator=generator)  # [S]
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                u[row] = torch.rand((), device=probs.device, generator=gen)
        cdf = probs.cumsum(dim=-1)  # [S, V]
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # [S, 1]
        drawn = drawn.clamp_(max=probs.shape[1] - 1)
        # rounding can leave the last step of a cdf flat: never return a token of no mass
        drawn = torch.where(probs.gather(1, drawn) > 0, drawn, greedy[:, None]).squeeze(1)
        token_ids = torch.where(temp > 0, drawn, greedy)
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    return score(raw_logprobs, token_ids, batch.max_num_logprobs or 0)


def rewind_draws(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Put a request's generator where `draws` single-row draws from `state` leave it: after
    a drafted step, where plain decoding would be having sampled the tokens that stood."""
    generator.set_state(state)
    for _ in range(draws):
        torch.rand((), device=generator.device, generator=generator)


def score(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int) -> SamplerOutput:
    """logprobs: [S, V] -> each row's logprob of `token_ids` [S] and its top `n` tokens."""
    top_ids = top_values = None
    if n == 1:  # a row maximum is cheaper than a top-k of one
        best = logprobs.max(dim=-1, keepdim=True)
        top_ids, top_values = best.indices, best.values
    elif n:
        top_values, top_ids = torch.topk(logprobs, n, dim=-1)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=logprobs.gather(1, token_ids[:, None]).squeeze(1),
        top_ids=top_ids,
        top_logprobs=top_values,
    )
