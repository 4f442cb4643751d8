"""engine.tokenizer: GGUF and HF-directory tokenizers against transformers, chat templates,
special tokens, save/load round trips and the synthetic byte tokenizer."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pytest
from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

from engine.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    TokenizerError,
    byte_tokenizer,
)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPIC_TEXTS = list(topics.values())
EXTRA_TEXTS = [
    "",
    " ",
    "0 12 345 6789 3.14159 1e-10 2024-01-31 v1.2.3 0x1F",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 ✨",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "mixed: naïve café Ωmega — “quotes” … ½",
    "a  b   c\t\t\n\n\n   \r\n x    \n\t  ",
    "   leading and trailing   ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12))\n",
    "I'm sure you've seen THEY'LL and we'd",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Write a haiku about 東京 🌸"},
        {"role": "assistant", "content": "Cherry blossoms fall\nover quiet temple roofs"},
        {"role": "user", "content": "Another, please."},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "tool_calls": None},
        {"role": "user", "content": "bye"},
    ],
]
# Exercises every environment feature transformers provides to templates.
RICH_TEMPLATE = (
    "{% if tools %}{{ 'Tools: ' + tools | tojson }}\n{{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% set ns = namespace(n=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined %}(tool calls){% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ ns.n }} turns, year {{ strftime_now('%Y')[:2] }}"
)


@pytest.fixture(scope="module")
def ours(smollm2_dir: str) -> Tokenizer:
    return Tokenizer.from_gguf(os.path.join(smollm2_dir, SMOLLM2_FILE))


@pytest.fixture(scope="module")
def reference(smollm2_dir: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=SMOLLM2_FILE)


@pytest.fixture(scope="module")
def digits_first_reference(reference: Any) -> BackendTokenizer:
    """transformers' backend with SmolLM2's own split (digits first, then GPT-2's regex).

    transformers' GGUF loader splits "smollm" text with the GPT-2 regex alone. SmolLM2's
    tokenizer.json and llama.cpp split digits off first, which changes how a whitespace run
    before a digit is cut; everything else (vocab, merges, specials) is transformers' own.
    """
    backend = BackendTokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


# SmolLM2 (byte-level BPE from GGUF) against transformers
def test_whole_corpus_ids_match_transformers(
    ours: Tokenizer, digits_first_reference: BackendTokenizer
) -> None:
    corpus = "\n\n".join(TOPIC_TEXTS)
    ids = ours.encode(corpus)
    assert len(ids) > 100_000
    assert ids == digits_first_reference.encode(corpus).ids
    assert ours.decode(ids) == corpus


@pytest.mark.parametrize("start", range(0, len(TOPIC_TEXTS), 10))
def test_topic_chunk_ids_match_transformers(
    ours: Tokenizer, reference: Any, digits_first_reference: BackendTokenizer, start: int
) -> None:
    for text in TOPIC_TEXTS[start : start + 10]:
        ids = ours.encode(text)
        assert ids == digits_first_reference.encode(text).ids
        if not re.search(r"\s{2}\d", text):
            assert ids == reference.encode(text)


@pytest.mark.parametrize("text", EXTRA_TEXTS)
def test_edge_string_ids_and_decode_match_transformers(
    ours: Tokenizer, reference: Any, digits_first_reference: BackendTokenizer, text: str
) -> None:
    ids = ours.encode(text)
    assert ids == digits_first_reference.encode(text).ids
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_digit_split_follows_llama_cpp_not_transformers_gguf(
    ours: Tokenizer, reference: Any
) -> None:
    text = "steps:\n\n1. go"
    pieces = ours.convert_ids_to_tokens(ours.encode(text))
    assert pieces[:4] == ["steps", ":", "ĊĊ", "1"]
    assert reference.convert_ids_to_tokens(reference.encode(text))[2:5] == ["Ċ", "Ċ", "1"]
    assert ours.encode("12345") == [33, 34, 35, 36, 37]


def test_special_tokens_in_text_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user<|im_end|><|endoftext|>")[:1] == [1]
    ids = ours.encode("a<|im_end|>b<|endoftext|>")
    assert 2 in ids
    assert 0 in ids
    assert ours.decode(ids) == "ab"
    assert ours.all_special_ids >= {0, 1, 2}
    assert ours.is_special(2)
    assert not ours.is_special(ours.encode("a")[0])


def test_smollm2_special_token_ids(ours: Tokenizer) -> None:
    assert ours.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert ours.bos_token_id == 1
    assert ours.eos_token_id == 2
    assert {0, 2} <= ours.eos_token_ids
    assert 1 not in ours.eos_token_ids
    assert not ours.add_bos_token
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)
    assert ours.vocab_size == 49152


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    assert text.startswith("<|im_start|>system\n")
    ids = ours.encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    expected_ids = reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert ids == list(expected_ids)


@pytest.mark.parametrize("tools", [None, [{"name": "get_weather", "city": "Zürich"}]])
def test_rich_template_matches_transformers(
    ours: Tokenizer, reference: Any, tools: list[dict[str, str]] | None
) -> None:
    calls = {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}
    conversation = [*CONVERSATIONS[3], calls, {"role": "tool", "content": "ignored"}]
    custom = ours.with_chat_template(RICH_TEMPLATE)
    text = custom.apply_chat_template(conversation, tools=tools)
    expected = reference.apply_chat_template(
        conversation,
        tools=tools,
        chat_template=RICH_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == expected
    assert "5 turns" in text
    assert text.count("(tool calls)") == 1  # the `tool_calls: None` key was dropped
    assert ("Zürich" in text) == (tools is not None)
    assert ours.chat_template != RICH_TEMPLATE


def test_template_errors_are_typed(ours: Tokenizer) -> None:
    custom = ours.with_chat_template(RICH_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        custom.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        ours.with_chat_template("{% for %}").apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.with_chat_template(None).encode_chat([{"role": "user", "content": "hi"}])


# Save and load
def test_gguf_save_from_dir_round_trip(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    loaded = Tokenizer.from_dir(str(tmp_path))
    for text in [*EXTRA_TEXTS, *TOPIC_TEXTS[::7]]:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.chat_template == ours.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    assert loaded.eos_token_ids == ours.eos_token_ids
    assert loaded.all_special_ids == ours.all_special_ids
    assert loaded.vocab_size == ours.vocab_size
    conversation = CONVERSATIONS[1]
    assert loaded.encode_chat(conversation) == ours.encode_chat(conversation)


def test_from_dir_reads_hf_variants(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT{{ messages | length }}"},
    ]
    config_path.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 7]}))
    loaded = Tokenizer.from_dir(str(tmp_path))
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT1"
    assert loaded.eos_token_id == 2
    assert loaded.eos_token_ids == {0, 2, 7}
    (tmp_path / "chat_template.jinja").write_text("JINJA")
    assert Tokenizer.from_dir(str(tmp_path)).apply_chat_template([]) == "JINJA"
    resaved = tmp_path / "resaved"
    loaded.save(str(resaved))
    assert Tokenizer.from_dir(str(resaved)).eos_token_ids == {0, 2, 7}


def test_from_dir_add_bos_token_flag(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True
    config_path.write_text(json.dumps(config))
    loaded = Tokenizer.from_dir(str(tmp_path))
    assert loaded.add_bos_token
    assert loaded.encode("hi") == [1, *ours.encode("hi")]
    assert loaded.encode("hi", add_special_tokens=False) == ours.encode("hi")
    assert loaded.encode_chat([{"role": "user", "content": "x"}])[0] == 1


def test_from_dir_reads_transformers_save_pretrained(
    ours: Tokenizer, reference: Any, tmp_path: Path
) -> None:
    reference.save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").exists()
    loaded = Tokenizer.from_dir(str(tmp_path))
    for text in [*EXTRA_TEXTS, *TOPIC_TEXTS[::5]]:
        assert loaded.encode(text) == reference.encode(text)
    assert loaded.chat_template == reference.chat_template == ours.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.eos_token_ids == ours.eos_token_ids


def test_from_dir_without_tokenizer_json_is_typed(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(str(tmp_path))


# GGUF files written here
def write_gguf(path: Path, model: str, tokens: list[str], **fields: Any) -> str:
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if "types" in fields:
        writer.add_token_types(fields["types"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    for name in ("bos", "eos", "unk"):
        if f"{name}_id" in fields:
            getattr(writer, f"add_{name}_token_id")(fields[f"{name}_id"])
    if "chat_template" in fields:
        writer.add_chat_template(fields["chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama-2 style vocabulary: specials, 256 byte tokens, and pieces with scores."""
    trained = BackendTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False)
    trained.train_from_iterator(TOPIC_TEXTS[:60], trainer)
    pieces = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    tokens += [piece for piece, _ in pieces]
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]
    template = "{% for m in messages %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    template += "{% endfor %}"
    path = tmp_path_factory.mktemp("sp") / "sp.gguf"
    return write_gguf(
        path,
        "llama",
        tokens,
        types=types,
        scores=scores,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        chat_template=template + "{{ eos_token }}",
    )


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf: str) -> None:
    import transformers

    directory, name = os.path.split(sentencepiece_gguf)
    reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ours = Tokenizer.from_gguf(sentencepiece_gguf)
    texts = [*TOPIC_TEXTS[60:], *EXTRA_TEXTS, "x<s>y</s>z", "  two leading spaces"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.add_bos_token
    assert ours.encode("hi")[0] == 1
    assert ours.eos_token_ids == {2}
    byte_pieces = [t for t in ours.convert_ids_to_tokens(ours.encode("中文 😀")) if "<0x" in t]
    assert len(byte_pieces) == 10
    conversation = CONVERSATIONS[0]
    expected = reference.apply_chat_template(conversation, tokenize=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=False) == expected
    assert ours.encode_chat(conversation).count(1) == 1


def test_unsupported_gguf_tokenizer_model_is_typed(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "[UNK]", "hello"])
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf(path)


def test_unreadable_gguf_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerError, match="cannot read GGUF"):
        Tokenizer.from_gguf(str(path))


# Synthetic byte tokenizer
def test_byte_tokenizer_is_bytes_plus_chatml() -> None:
    tokenizer = byte_tokenizer(512)
    text = "héllo 😀 中文\n\t<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == [*"héllo 😀 中文\n\t".encode(), 258]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode(bytes(range(256)).decode("latin-1")) == [
        byte for char in bytes(range(256)).decode("latin-1") for byte in char.encode()
    ]
    assert tokenizer.vocab_size == 512
    assert tokenizer.eos_token_id == 258
    assert tokenizer.eos_token_ids == {256, 258}
    assert tokenizer.bos_token_id is None
    assert tokenizer.all_special_ids == {256, 257, 258}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}])[:2] == [257, *b"u"]


def test_byte_tokenizer_rejects_small_vocab() -> None:
    with pytest.raises(TokenizerError, match="259"):
        byte_tokenizer(258)
