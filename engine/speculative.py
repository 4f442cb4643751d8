"""Speculative decoding by prompt lookup: draft tokens copied from the request's own context
(`NgramIndex`), which requests may be drafted for, how many drafts stand (`accept`), and
whether drafting pays at the current batch size (`DraftGate`). The output is exactly plain
decoding's. The design is in docs/design/scheduler.md.
"""

from __future__ import annotations

import statistics
from collections import deque

from engine.protocol import SamplingParams


class NgramIndex:
    """Where each n-gram of a token sequence last occurred, for n in [min_n, max_n], kept up
    to date as tokens are appended, and where the sequence is copying from.

    The n-grams ending at the newest token are registered only once a token follows them,
    so a lookup of the sequence's own suffix finds an earlier occurrence, never itself.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        # n-gram -> index of the token that followed its latest occurrence
        self.follows: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # tokens whose preceding n-grams are registered
        # the last drafts: the index they were copied from, and the length of the sequence
        # then (None: no drafts)
        self.source: int | None = None
        self.proposed_at = 0

    def extend(self, tokens: list[int]) -> None:
        """Register the n-grams followed by tokens[num_indexed:] (all but the last token's)."""
        follows = self.follows
        for end in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                follows[tuple(tokens[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: list[int]) -> int | None:
        """The index of the token after the latest earlier occurrence of the longest suffix
        of `tokens` (of min_n to max_n tokens); None when there is none."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.follows.get(tuple(tokens[-n:]))
            if start is not None:
                return start
        return None

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """`k` draft tokens to follow `tokens`: what followed the longest earlier match of its
        end, or [] when there is none.

        While the tokens since the last drafts are exactly what followed their source, the
        sequence is copying that place, and the drafts go on from there: that match is
        longer than any n-gram. Otherwise they follow `lookup`. A continuation that runs
        into the end of `tokens` goes on with its own drafts, as if the sequence repeated
        itself (a list or a table row being written again)."""
        start = None
        arrived = len(tokens) - self.proposed_at
        if self.source is not None and arrived > 0:
            copied = tokens[self.source : self.source + arrived]
            if copied == tokens[self.proposed_at :]:
                start = self.source + arrived
        if start is None:
            start = self.lookup(tokens)
        self.source, self.proposed_at = start, len(tokens)
        if start is None:
            return []
        drafts = tokens[start : start + k]
        while len(drafts) < k:
            drafts.append(drafts[start + len(drafts) - len(tokens)])
        return drafts


def draftable(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when each of a request's next tokens is sampled from its position's logits alone
    (not from the tokens before it, as penalties are), so drafts can be checked against each
    position's own sample and change nothing in its output."""
    return (
        params.logprobs is None
        and not params.logit_bias
        and not params.frequency_penalty
        and not params.presence_penalty
        and params.repetition_penalty == 1.0
        and not params.is_constrained
        and num_output_tokens >= params.min_tokens
    )


def accept(first: int, drafts: list[int], verified: list[int]) -> list[int]:
    """The tokens a drafted step yields: the model's token after the known ones (`first`),
    then, while the previous token matches its draft, the model's token after that draft
    (`verified[j]` follows draft j)."""
    out = [first]
    for draft, after in zip(drafts, verified, strict=True):
        if out[-1] != draft:
            break
        out.append(after)
    return out


class DraftGate:
    """Whether drafting pays here and now, measured rather than assumed.

    A drafted step costs more than a plain one: more rows, and on a GPU an eager forward
    where a plain decode step replays a CUDA graph. It pays when the tokens its drafts add
    outweigh that. Per batch size (bucketed by powers of two), the gate keeps the tokens per
    second of the latest decode-only steps with drafts and without, and lets the scheduler
    draft while the median of the first is at least the median of the second. It takes
    `samples` steps of each kind before it judges (a median of three ignores one step slowed
    by something else), and whichever kind loses is still tried once every `probe_every`
    steps of that size, so the judgement follows the load and the machine.
    """

    def __init__(self, probe_every: int = 32, samples: int = 3, window: int = 8) -> None:
        self.probe_every = probe_every
        self.samples = samples
        self.window = window
        # bucket -> kind (True: drafted) -> tokens per second of its latest steps
        self._rates: dict[int, dict[bool, deque[float]]] = {}
        self._steps: dict[int, int] = {}  # bucket -> judgements taken

    @staticmethod
    def _bucket(batch: int) -> int:
        return (batch - 1).bit_length()  # 1, 2, 3-4, 5-8, ...

    def allow(self, batch: int) -> bool:
        """Whether a decode step of `batch` requests may carry drafts (a decision: counts
        towards the next probe)."""
        bucket = self._bucket(batch)
        rates = self._rates.get(bucket, {})
        if len(rates.get(True, ())) < self.samples:
            return True  # drafting is tried first
        if len(rates.get(False, ())) < self.samples:
            return False  # then plain steps, to compare with
        n = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        pays = self.rate(batch, drafted=True) >= self.rate(batch, drafted=False)
        return pays != (n % self.probe_every == 0)

    def record(self, batch: int, seconds: float, tokens: int, *, drafted: bool) -> None:
        """A decode-only step of `batch` requests took `seconds` and produced `tokens`."""
        kinds = self._rates.setdefault(self._bucket(batch), {})
        kinds.setdefault(drafted, deque(maxlen=self.window)).append(tokens / max(seconds, 1e-9))

    def rate(self, batch: int, *, drafted: bool) -> float:
        """The median tokens per second of the latest steps of this size and kind (0 if
        none)."""
        rates = self._rates.get(self._bucket(batch), {}).get(drafted)
        return statistics.median(rates) if rates else 0.0
