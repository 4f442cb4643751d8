"""llama.cpp as a benchmark peer, through llama-cpp-python's low-level API: a GGUF file run
on given token ids, N concurrent requests as N sequences of one batch (one `llama_decode`
for every sequence's next token), greedy. Installed by `make bench-peers`."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

# the number of prompt tokens one decode call takes, as Strata's max_num_batched_tokens
PREFILL_CHUNK = 2048

MODE = "batched"  # N sequences in one llama_batch, one decode call per step


_LOG_CALLBACK: list[Any] = []  # kept alive while llama.cpp may call it


def _silence(llama_cpp: Any) -> None:
    """No llama.cpp log lines on stderr: the bench prints its own."""
    if not _LOG_CALLBACK:
        _LOG_CALLBACK.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
        llama_cpp.llama_log_set(_LOG_CALLBACK[0], ctypes.c_void_p(0))


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    import llama_cpp

    return str(llama_cpp.__version__)


class LlamaCppPeer:
    """One model loaded from `gguf_path`, run on `threads` threads; a context per number
    of concurrent sequences, made outside the timings by `prepare`."""

    def __init__(self, gguf_path: str, threads: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        _silence(llama_cpp)
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.threads = threads
        self._ctx: Any = None
        self._ctx_shape: tuple[int, int] = (0, 0)
        self._batch: Any = None

    def prepare(self, seqs: int, tokens_per_seq: int) -> None:
        """A context for `seqs` sequences of up to `tokens_per_seq` tokens each (the last
        one's is kept while the shape stays the same)."""
        if self._ctx_shape == (seqs, tokens_per_seq):
            return
        self._free_context()
        lib = self._lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = seqs * tokens_per_seq
        cparams.n_batch = max(PREFILL_CHUNK, seqs)
        cparams.n_seq_max = seqs
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        ctx = lib.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {seqs} sequences")
        self._ctx = ctx
        self._ctx_shape = (seqs, tokens_per_seq)
        self._batch = lib.llama_batch_init(cparams.n_batch, 0, 1)

    def _free_context(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        self._ctx_shape = (0, 0)

    def close(self) -> None:
        self._free_context()
        if self._model is not None:
            self._lib.llama_model_free(self._model)
            self._model = None

    def _clear(self) -> None:
        lib = self._lib
        if hasattr(lib, "llama_get_memory"):
            lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        else:
            lib.llama_kv_self_clear(self._ctx)

    def _argmax(self, index: int) -> int:
        ptr = self._lib.llama_get_logits_ith(self._ctx, index)
        logits = np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        )
        return int(logits.argmax())

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One decode call of (token, position, sequence, wants logits) entries."""
        b = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self._lib.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of every prompt, `new_tokens` each (end of sequence
        ignored): the prompts in chunks of up to PREFILL_CHUNK tokens, then one decode
        call per step for all sequences."""
        seqs, longest = len(prompts), max(map(len, prompts))
        self.prepare(seqs, longest + new_tokens)
        self._clear()
        out: list[list[int]] = [[] for _ in prompts]
        pending: list[tuple[int, int, int, bool]] = []
        wanted: list[int] = []  # the sequence whose last prompt token each logits row is
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                last = pos == len(prompt) - 1
                pending.append((token, pos, seq, last))
                if last:
                    wanted.append(seq)
                if len(pending) == PREFILL_CHUNK:
                    self._collect(pending, wanted, out)
                    pending, wanted = [], []
        if pending:
            self._collect(pending, wanted, out)
        for step in range(1, new_tokens):
            self._decode([(out[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(seqs)])
            for s in range(seqs):
                out[s].append(self._argmax(s))
        return out

    def _collect(
        self, entries: list[tuple[int, int, int, bool]], wanted: list[int], out: list[list[int]]
    ) -> None:
        self._decode(entries)
        rows = [i for i, e in enumerate(entries) if e[3]]
        for row, seq in zip(rows, wanted, strict=True):
            out[seq].append(self._argmax(row))

    def tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Generated tokens/s over the whole batch, prefill included (the context is made
        before the clock starts)."""
        self.prepare(len(prompts), max(map(len, prompts)) + new_tokens)
        start = time.perf_counter()
        out = self.generate(prompts, new_tokens)
        elapsed = time.perf_counter() - start
        produced = sum(map(len, out))
        assert produced == len(prompts) * new_tokens, produced
        return produced / elapsed

    def prefill_tok_s(self, prompt: list[int]) -> float:
        """Prompt tokens/s of one prompt's prefill (one new token)."""
        self.prepare(1, len(prompt) + 1)
        start = time.perf_counter()
        self.generate([prompt], 1)
        return len(prompt) / (time.perf_counter() - start)
