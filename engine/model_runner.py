"""Turns a scheduled step into tensors, runs one batched forward, samples the batch.

The runner owns the model, the attention backend and the engine's random stream. It reads
requests (token ids, positions, block tables) but never changes scheduling state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.paged import PagedAttention, SeqSlice
from engine.attention.triton_backend import TritonPagedAttention
from engine.cuda_graphs import DecodeGraphs
from engine.device import to_device
from engine.kernels.cpu import CpuKernels
from engine.lora.batch import LoRABatch
from engine.model.llama import LlamaForCausalLM
from engine.protocol import TokenLogprob
from engine.request import Request
from engine.sampler import SamplerOutput, build_sampling_batch, sample, score
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kvstore.device_pool import DeviceKVPool

# fp32 logits computed at once when scoring prompts: [rows, vocab] within this many bytes.
# Below glibc's largest mmap threshold (32 MiB), so the buffer is reused from the heap
# instead of being mapped, faulted in and zeroed again for every slice.
_SCORE_BYTES = 24 << 20

# a request scoring its prompt this step: its rows in the flattened step, and the position of
# the first of them (each row scores the prompt token after its position)
_Scored = tuple[Request, range, int]


@dataclass(frozen=True)
class RunnerOutput:
    """One sampled token (and optional logprobs) per request whose chunk reached its end,
    and the new prompt-token scores of requests that asked for them.

    A request with drafts also gets `verified`: the token sampled after each of its `drafts`
    (engine/speculative.py decides how many of them stand)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per request; [] for none
    verified: list[list[int]] = field(default_factory=list)
    # seeded drafted requests: their generator's state after drawing for their first row
    draw_states: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptScores:
    """Prompt tokens scored in one step (on the device until `RunnerOutput` is built)."""

    spans: list[tuple[Request, int]]  # each request and how many of the rows are its own
    out: SamplerOutput  # one row per scored token: its id, logprob and top alternatives


@dataclass(frozen=True)
class Launched:
    """A step queued on the device: the sampled requests, their sampler output and the
    prompt scores, none of them read back to the host yet."""

    sampled: list[Request]
    out: SamplerOutput | None
    prompt: PromptScores | None = None
    drafts: list[list[int]] = field(default_factory=list)  # per sampled request
    verified: torch.Tensor | None = None  # [D] the token sampled after each draft, in order
    draw_states: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: DeviceKVPool,
        device: torch.device,
        seed: int = 0,
        kernels: CpuKernels | None = None,
        lora: LoRABatch | None = None,
        triton: bool = False,
        eos_token_ids: frozenset[int] = frozenset(),
        pdl: bool = False,
    ) -> None:
        """`eos_token_ids`: what a request's min_tokens holds back. `pdl`: the Triton
        attention kernels launch to start early (engine/kernels/triton_pdl.py)."""
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.pool = pool
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.attn: PagedAttention | TritonPagedAttention
        if triton:
            self.attn = TritonPagedAttention(pool, model.config.num_heads, pdl=pdl)
        else:
            self.attn = PagedAttention(pool, model.config.num_heads, kernels=kernels)
        self.argmax = kernels.argmax if kernels is not None and device.type == "cpu" else None
        self.lora = lora  # set to each token's adapter slot before every forward
        self.graphs: DecodeGraphs | None = None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def use_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Run decode-only steps of up to `max_batch` sequences from captured CUDA graphs
        (over static, padded buffers on any device; captured on CUDA). Triton backend only,
        adapters included (on the Triton LoRA kernels)."""
        assert isinstance(self.attn, TritonPagedAttention)
        self.graphs = DecodeGraphs(self.model, self.attn, max_batch, max_model_len, self.lora)
        self.graphs.capture()

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        """Run the forward for every scheduled token; sample where a sequence is complete.

        Mutates only the KV pool (new K/V written) and the runner's random stream.
        """
        launched = self.launch(step)
        prompt = [] if launched.prompt is None else _prompt_logprobs(launched.prompt)
        sampled, out = launched.sampled, launched.out
        if out is None:
            return RunnerOutput([], [], [], prompt)
        # the step's one host sync (one more when it scored prompts)
        if launched.verified is None:
            token_ids = out.token_ids.tolist()
            return RunnerOutput(sampled, token_ids, self._logprobs(sampled, out), prompt)
        ids = torch.cat([out.token_ids, launched.verified]).tolist()
        token_ids, rest = ids[: len(sampled)], iter(ids[len(sampled) :])
        verified = [[next(rest) for _ in drafts] for drafts in launched.drafts]
        logprobs = self._logprobs(sampled, out)
        return RunnerOutput(
            sampled, token_ids, logprobs, prompt, launched.drafts, verified, launched.draw_states
        )

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> Launched:
        """Queue the step's forward and sampling (and prompt scoring) on the device without
        waiting for it; returns the sampled requests and their (device) sampler output."""
        # decode tokens first: the attention backend batches them without padding
        order = sorted(step.scheduled, key=lambda s: s.num_new_tokens > 1)
        input_ids, positions, slices, sample_rows, draft_rows = self._flatten(order)
        scored = _positions_to_score(order)
        lora_slots = None
        if self.lora is not None:
            lora_slots = [s.request.lora_slot for s in order for _ in range(s.num_new_tokens)]
        # the forward is queued first, and the sampling inputs built while the device runs
        # it: from here to the token ids the host never waits for the device
        hidden = self.forward(input_ids, positions, slices, lora_slots)  # [T, hidden]
        finishing = [s for s in order if s.completes_sequence]
        sampled = [s.request for s in finishing]
        prompt = self._score_prompts(hidden, scored) if scored else None
        if not sampled:
            return Launched([], None, prompt)
        batch = build_sampling_batch(sampled, self.vocab_size, self.device, self.eos_token_ids)
        rows = sample_rows + draft_rows
        if rows != list(range(len(input_ids))):  # not a step of decode tokens alone
            rows_t = to_device(torch.tensor(rows, dtype=torch.long), self.device)
            hidden = hidden.index_select(0, rows_t)
        logits = self.model.compute_logits(hidden)  # [S + D, vocab]
        out = sample(logits[: len(sample_rows)], batch, self.generator, self.argmax)
        if not draft_rows:
            return Launched(sampled, out, prompt)
        # each draft's row is sampled as its position would be without drafts (a seeded
        # request's next uniform numbers, in order): a draft stands if it is that sample
        drafted = [s.request for s in finishing for _ in s.draft_token_ids]
        states = {r.request_id: r.generator.get_state() for r in drafted if r.generator is not None}
        after = logits[len(sample_rows) :]
        if all(r.params.is_greedy for r in drafted):
            verified = self.argmax(after) if self.argmax is not None else after.argmax(dim=-1)
        else:
            rows_batch = build_sampling_batch(drafted, self.vocab_size, self.device)
            verified = sample(after, rows_batch, self.generator, self.argmax).token_ids
        drafts = [s.draft_token_ids for s in finishing]
        return Launched(sampled, out, prompt, drafts, verified, states)

    def _score_prompts(self, hidden: torch.Tensor, scored: list[_Scored]) -> PromptScores:
        """Each scored row's logits against the prompt token after its position, a slice of
        rows at a time (`_SCORE_BYTES` of logits)."""
        rows = [r for _, span, _ in scored for r in span]
        targets = [
            req.all_token_ids[first + 1 + k]
            for req, span, first in scored
            for k in range(len(span))
        ]
        top_n = max(req.params.prompt_logprobs or 0 for req, _, _ in scored)
        rows_t = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        targets_t = to_device(torch.tensor(targets, dtype=torch.long), self.device)
        parts = []
        step = max(1, _SCORE_BYTES // (4 * self.vocab_size))
        for i in range(0, len(rows), step):
            logits = self.model.compute_logits(hidden[rows_t[i : i + step]])
            logits -= logits.logsumexp(dim=-1, keepdim=True)  # log-softmax, in place
            parts.append(score(logits, targets_t[i : i + step], top_n))
        out = SamplerOutput(
            targets_t,
            _cat([p.logprobs for p in parts]),
            _cat([p.top_ids for p in parts]),
            _cat([p.top_logprobs for p in parts]),
        )
        return PromptScores([(req, len(span)) for req, span, _ in scored], out)

    def forward(
        self,
        input_ids: list[int],
        positions: list[int],
        slices: list[SeqSlice],
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flattened step (decode sequences first);
        writes the step's K/V. A decode-only step within the captured sizes replays a graph.
        `lora_slots`: each token's adapter slot, when adapters are enabled."""
        graphs = self.graphs
        if graphs is not None and len(input_ids) == len(slices) and graphs.fits(len(slices)):
            self.attn.pool.loads.wait_all()  # a graph's kernels wait on no layer's loads
            return graphs.run(input_ids, slices, lora_slots)
        ctx = self.attn.build_context(slices)
        ids_t = to_device(torch.tensor(input_ids, dtype=torch.long), self.device)
        pos_t = to_device(torch.tensor(positions, dtype=torch.long), self.device)
        if self.lora is not None:
            assert lora_slots is not None
            self.lora.set(lora_slots, self.device)
        return self.model(ids_t, pos_t, self.attn, ctx)

    def _flatten(
        self, order: list[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[SeqSlice], list[int], list[int]]:
        """The step's tokens, positions and sequences, the row sampled for each completed
        sequence, and the rows of drafts (each scoring the token after its draft)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        sample_rows: list[int] = []
        draft_rows: list[int] = []
        for s in order:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            drafts = s.draft_token_ids
            input_ids.extend(s.request.all_token_ids[start : end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slices.append(SeqSlice(s.num_new_tokens, start, s.block_table))
            if s.completes_sequence:
                sample_rows.append(len(input_ids) - 1 - len(drafts))
                draft_rows.extend(range(len(input_ids) - len(drafts), len(input_ids)))
        return input_ids, positions, slices, sample_rows, draft_rows

    @staticmethod
    def _logprobs(requests: list[Request], out: SamplerOutput) -> list[TokenLogprob | None]:
        if out.logprobs is None:
            return [None] * len(requests)
        token_ids = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result: list[TokenLogprob | None] = []
        for i, req in enumerate(requests):
            n = req.params.logprobs
            if n is None:
                result.append(None)
                continue
            result.append(
                TokenLogprob(
                    token_id=token_ids[i],
                    logprob=lps[i],
                    top_ids=top_ids[i][:n] if top_ids else [],
                    top_logprobs=top_lps[i][:n] if top_lps else [],
                )
            )
        return result


def _positions_to_score(order: list[ScheduledRequest]) -> list[_Scored]:
    scored = []
    row = 0
    for s in order:
        start = s.request.num_computed_tokens
        span = s.request.positions_to_score(start, start + s.num_new_tokens)
        if span:
            first_row = row + span.start - start
            scored.append((s.request, range(first_row, first_row + len(span)), span.start))
        row += s.num_new_tokens
    return scored


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat([p for p in parts if p is not None])


def _prompt_logprobs(scores: PromptScores) -> list[tuple[Request, list[TokenLogprob]]]:
    """The step's prompt scores, per request, as host records (one device sync)."""
    out = scores.out
    assert out.logprobs is not None
    ids, lps = out.token_ids.tolist(), out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result = []
    row = 0
    for req, count in scores.spans:
        n = req.params.prompt_logprobs or 0
        records = [
            TokenLogprob(
                token_id=ids[r],
                logprob=lps[r],
                top_ids=top_ids[r][:n] if top_ids and n else [],
                top_logprobs=top_lps[r][:n] if top_lps and n else [],
            )
            for r in range(row, row + count)
        ]
        result.append((req, records))
        row += count
    return result
