"""Text <-> token ids and chat templates, built from a GGUF file or an HF model directory.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust fast tokenizer). BOS/EOS insertion lives in
that backend's post-processor, so `encode` and a saved `tokenizer.json` always agree. Chat
templates render the way transformers renders them (sandboxed jinja2, `tojson` without ASCII
escaping, `raise_exception`, `strftime_now`).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from gguf import GGUFReader, GGUFValueType
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer


class TokenizerError(ValueError):
    """A tokenizer description (GGUF metadata, model directory) that cannot be built."""


class ChatTemplateError(ValueError):
    """A chat template that is missing, does not compile, or rejects the conversation."""


END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# llama.cpp token types (`tokenizer.ggml.token_type`)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# `tokenizer.ggml.pre` names, grouped the way llama.cpp picks its split expressions
_DIGITS_FIRST_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell"})
_LLAMA3_PRES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})


class Tokenizer:
    """A fast tokenizer plus the model's special token ids and chat template.

    Nothing mutates it after construction. `vocab_size` is the model's vocabulary size, which
    may exceed the tokenizer's when embedding rows are padded. `eos_token_ids` holds EOS plus
    the end-of-turn tokens the vocabulary has as special tokens: generation stops on any.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        num_model_tokens: int = 0,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.vocab_size = max(num_model_tokens, backend.get_vocab_size(with_added_tokens=True))
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, token in added.items() if token.special)
        self._extra_eos_token_ids = frozenset(extra_eos_token_ids)
        end_of_turn = {
            i for i in (backend.token_to_id(token) for token in END_OF_TURN_TOKENS) if i is not None
        }
        self.eos_token_ids: frozenset[int] = frozenset(
            (end_of_turn & self.all_special_ids)
            | ({eos_token_id} if eos_token_id is not None else set())
            | self._extra_eos_token_ids
        )
        with_specials = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = bos_token_id is not None and with_specials[:1] == [bos_token_id]
        self.add_eos_token = eos_token_id is not None and with_specials[-1:] == [eos_token_id]

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        meta = _read_tokenizer_metadata(path)
        kind, tokens = meta.get("ggml.model"), meta.get("ggml.tokens", [])
        types = meta.get("ggml.token_type") or [_NORMAL] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_backend(meta, tokens, types)
        elif kind == "llama":
            backend = _sentencepiece_backend(meta, tokens, types)
        else:
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)"
            )
        typed = list(zip(tokens, types, strict=True))
        backend.add_special_tokens([_added(t, True) for t, k in typed if k in {_CONTROL, _UNKNOWN}])
        backend.add_tokens([_added(t, False) for t, k in typed if k == _USER_DEFINED])
        bos_id, eos_id = meta.get("ggml.bos_token_id"), meta.get("ggml.eos_token_id")
        add_bos = meta.get("ggml.add_bos_token", kind == "llama") and bos_id is not None
        add_eos = meta.get("ggml.add_eos_token", False) and eos_id is not None
        backend.post_processor = _bos_eos_processor(
            backend, tokens[bos_id] if add_bos else None, tokens[eos_id] if add_eos else None
        )
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_template=meta.get("chat_template"),
            num_model_tokens=len(tokens),
        )

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load an HF model directory: `tokenizer.json`, and optionally `tokenizer_config.json`,
        `chat_template.jinja` (wins over the config's template) and `generation_config.json`."""
        try:
            backend = BackendTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as exc:
            raise TokenizerError(f"cannot load {path}/tokenizer.json: {exc}") from exc
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {entry["name"]: entry["template"] for entry in template}.get("default")
        if os.path.exists(jinja_path := os.path.join(path, "chat_template.jinja")):
            template = Path(jinja_path).read_text("utf-8")
        bos, eos = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos is not None else None
        eos_id = backend.token_to_id(eos) if eos is not None else None
        generation = _read_json(os.path.join(path, "generation_config.json"))
        extra_eos = generation.get("eos_token_id") or []
        extra_eos = [extra_eos] if isinstance(extra_eos, int) else [int(i) for i in extra_eos]
        eos_id = extra_eos[0] if eos_id is None and extra_eos else eos_id
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = _bos_eos_processor(
                backend,
                bos if config.get("add_bos_token") and bos_id is not None else None,
                eos if config.get("add_eos_token") and eos_id is not None else None,
            )
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_template=template,
            extra_eos_token_ids=extra_eos,
        )

    def save(self, path: str) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (and `generation_config.json` when
        EOS ids came from one) into directory `path`, creating it; `from_dir` round-trips."""
        os.makedirs(path, exist_ok=True)
        self._backend.save(os.path.join(path, "tokenizer.json"))
        config = {
            "bos_token": self._token(self.bos_token_id),
            "eos_token": self._token(self.eos_token_id),
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "chat_template": self.chat_template,
        }
        _write_json(os.path.join(path, "tokenizer_config.json"), config)
        if self._extra_eos_token_ids:
            ids = sorted(self._extra_eos_token_ids)
            _write_json(os.path.join(path, "generation_config.json"), {"eos_token_id": ids})

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """A copy that renders chats with `chat_template` (an operator override); `self` is
        unchanged."""
        clone = copy.copy(self)
        clone.chat_template = chat_template
        clone.__dict__.pop("_compiled_template", None)
        return clone

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS only where the model does.

        Releases the GIL while it works (the batch entry point does; the single one does
        not), so other threads keep running during a long text."""
        batch = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the tokenizer's vocabulary decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary spelling of each id (byte-level tokens stay byte-spelled); "" if unknown."""
        return [self._token(token_id) or "" for token_id in ids]

    def token_bytes(self) -> list[bytes | None]:
        """The bytes each model token id adds to decoded text: None for special tokens and for
        ids the tokenizer does not know. For structured output, which checks tokens' bytes."""
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in _decoder_types(decoder)
        unspell = {char: byte for byte, char in enumerate(_byte_alphabet())}
        added = self._backend.get_added_tokens_decoder()
        table: list[bytes | None] = [None] * self.vocab_size
        for token_id in range(min(self.vocab_size, self._backend.get_vocab_size(True))):
            token = self._backend.id_to_token(token_id)
            if token is None or token_id in self.all_special_ids:
                continue
            if token_id in added:  # added tokens are spelled as the text they stand for
                table[token_id] = token.encode()
            elif byte_level and all(char in unspell for char in token):
                table[token_id] = bytes(unspell[char] for char in token)
            elif not byte_level and (byte := _BYTE_FALLBACK.fullmatch(token)):
                table[token_id] = bytes((int(byte[1], 16),))
            else:
                table[token_id] = token.replace("▁", " ").encode()
        return table

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary entry spelled `token` (None if there is none)."""
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token, which `skip_special_tokens` drops."""
        return token_id in self.all_special_ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (keys whose value is None are
        dropped first, as transformers does); extra kwargs such as `tools` become variables."""
        template = self._compiled_template
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if (token := self._token(token_id)) is not None:
                variables[name] = token
        plain = [{k: v for k, v in message.items() if v is not None} for message in messages]
        variables |= {**kwargs, "messages": plain, "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(**variables)
        except (jinja2.TemplateError, TypeError) as exc:
            raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat, without adding BOS (templates write their own)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    def _token(self, token_id: int | None) -> str | None:
        return self._backend.id_to_token(token_id) if token_id is not None else None


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """A deterministic byte-level tokenizer with a ChatML template, for random-weight models.

    Ids 0-255 are the bytes, 256-258 `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (EOS); ids
    from 259 up to `vocab_size` are unused.
    """
    if vocab_size < 259:
        raise TokenizerError(f"byte tokenizer needs vocab_size >= 259, got {vocab_size}")
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    backend.add_special_tokens([_added(token, True) for token in specials])
    return Tokenizer(
        backend, eos_token_id=258, chat_template=CHATML_TEMPLATE, num_model_tokens=vocab_size
    )


def _byte_level_backend(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> BackendTokenizer:
    """GPT-2 style byte-level BPE, splitting text the way llama.cpp does for `ggml.pre`."""
    spelled = _byte_alphabet()
    alphabet = set(spelled)
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in {_CONTROL, _USER_DEFINED} and not set(token) <= alphabet:
            token = "".join(spelled[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(token, token_id)
    pre = meta.get("ggml.pre", "default")
    merges = _split_merges(meta.get("ggml.merges", []))
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRES)
    )
    regex = _QWEN2_SPLIT if pre in _QWEN2_PRES else _GPT2_SPLIT
    regex = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else regex
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre in _DIGITS_FIRST_PRES:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps += [
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> BackendTokenizer:
    """Llama-2 style BPE over "▁"-joined text with `<0xNN>` byte fallback."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if "ggml.merges" in meta:
        merges = _split_merges(meta["ggml.merges"])
    else:
        merges = _merges_from_scores(vocab, types, meta.get("ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(model)
    add_space_prefix = meta.get("ggml.add_space_prefix", True)
    prepend = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    vocab: Mapping[str, int], types: Sequence[int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces, best token score first (ties:
    longer left piece, longer right piece, token order, piece ids)."""
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for token, token_id in vocab.items():
        if types[token_id] != _NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                key = (-scores[token_id], -len(left), -len(right), token_id)
                ranked.append((*key, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _split_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    return [(left, right) for left, right in (merge.split(" ", 1) for merge in merges)]


def _bos_eos_processor(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> processors.PostProcessor | None:
    """Adds `bos` before and `eos` after the text; None leaves that side alone."""
    if bos is None and eos is None:
        return None
    single = " ".join(t for t in (bos, "$A", eos) if t is not None)
    specials = {t: backend.token_to_id(t) for t in (bos, eos) if t is not None}
    return processors.TemplateProcessing(single=single, special_tokens=list(specials.items()))


def _decoder_types(decoder: Mapping[str, Any]) -> set[str]:
    """The `type` of a serialized decoder and of every decoder it chains."""
    types = {decoder.get("type", "")}
    for part in decoder.get("decoders") or ():
        types |= _decoder_types(part)
    return types


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, normalized=False, special=special)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of each byte value, indexed by byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [byte for byte in range(256) if byte not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return [chars[byte] for byte in range(256)]


def _read_tokenizer_metadata(path: str) -> dict[str, Any]:
    """The GGUF `tokenizer.*` fields, keyed without that prefix; arrays become lists."""
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            parts = [field.parts[i] for i in field.data]
            if field.types[-1] == GGUFValueType.STRING:
                values = [bytes(part).decode("utf-8") for part in parts]
            else:
                values = [part.tolist()[0] for part in parts]
            is_array = field.types[0] == GGUFValueType.ARRAY
            meta[name.removeprefix("tokenizer.")] = values if is_array else values[0]
    return meta


def _read_json(path: str) -> dict[str, Any]:
    return dict(json.loads(Path(path).read_text("utf-8"))) if os.path.exists(path) else {}


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, ensure_ascii=False, indent=2), "utf-8")


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    return token.get("content") if isinstance(token, Mapping) else token


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; it renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _tojson(value: Any, ensure_ascii: bool = False, **options: Any) -> str:
    """transformers' `tojson`: no ASCII or HTML escaping; `indent`, `separators`, `sort_keys`."""
    return json.dumps(value, ensure_ascii=ensure_ascii, **options)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
