"""Turns a scheduled step into tensors, runs one batched forward, samples the batch.

The runner owns the model, the attention backend and the engine's random stream. It reads
requests (token ids, positions, block tables) but never changes scheduling state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.paged import PagedAttention, SeqSlice
from engine.attention.triton_backend import TritonPagedAttention
from engine.cuda_graphs import DecodeGraphs
from engine.device import to_device
from engine.kernels.cpu import CpuKernels
from engine.lora.layers import LoRABatch
from engine.model.llama import LlamaForCausalLM
from engine.protocol import TokenLogprob
from engine.request import Request
from engine.sampler import SamplerOutput, build_sampling_batch, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kvstore.device_pool import DeviceKVPool


@dataclass(frozen=True)
class RunnerOutput:
    """One sampled token (and optional logprobs) per request whose chunk reached its end."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


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
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.attn: PagedAttention | TritonPagedAttention
        if triton:
            self.attn = TritonPagedAttention(pool, model.config.num_heads)
        else:
            self.attn = PagedAttention(pool, model.config.num_heads, kernels=kernels)
        self.argmax = kernels.argmax if kernels is not None and device.type == "cpu" else None
        self.lora = lora  # set to each token's adapter slot before every forward
        self.graphs: DecodeGraphs | None = None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def use_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Run decode-only steps of up to `max_batch` sequences from captured CUDA graphs
        (over static, padded buffers on any device; captured on CUDA). Triton backend only."""
        assert isinstance(self.attn, TritonPagedAttention)
        self.graphs = DecodeGraphs(self.model, self.attn, max_batch, max_model_len)
        self.graphs.capture()

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        """Run the forward for every scheduled token; sample where a sequence is complete.

        Mutates only the KV pool (new K/V written) and the runner's random stream.
        """
        sampled, out = self.launch(step)
        if out is None:
            return RunnerOutput([], [], [])
        token_ids = out.token_ids.tolist()  # the step's one host sync
        return RunnerOutput(sampled, token_ids, self._logprobs(sampled, out))

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Queue the step's forward and sampling on the device without waiting for it;
        returns the sampled requests and their (device) sampler output."""
        # decode tokens first: the attention backend batches them without padding
        order = sorted(step.scheduled, key=lambda s: s.num_new_tokens > 1)
        input_ids, positions, slices, sample_rows = self._flatten(order)
        lora_slots = None
        if self.lora is not None:
            lora_slots = [s.request.lora_slot for s in order for _ in range(s.num_new_tokens)]
        # every host-side input is built and queued first: from here to the token ids the
        # host never waits for the device
        sampled = [s.request for s in order if s.completes_sequence]
        batch = build_sampling_batch(sampled, self.vocab_size, self.device) if sampled else None
        rows = to_device(torch.tensor(sample_rows, dtype=torch.long), self.device)
        hidden = self.forward(input_ids, positions, slices, lora_slots)  # [T, hidden]
        if batch is None:
            return [], None
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [S, vocab]
        return sampled, sample(logits, batch, self.generator, self.argmax)

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
            return graphs.run(input_ids, slices)
        ctx = self.attn.build_context(slices)
        ids_t = to_device(torch.tensor(input_ids, dtype=torch.long), self.device)
        pos_t = to_device(torch.tensor(positions, dtype=torch.long), self.device)
        if self.lora is not None:
            assert lora_slots is not None
            self.lora.set(lora_slots, self.device)
        return self.model(ids_t, pos_t, self.attn, ctx)

    def _flatten(
        self, order: list[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[SeqSlice], list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        sample_rows: list[int] = []
        for s in order:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slices.append(SeqSlice(s.num_new_tokens, start, s.block_table))
            if s.completes_sequence:
                sample_rows.append(len(input_ids) - 1)
        return input_ids, positions, slices, sample_rows

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
