"""engine.detokenizer: incremental decoding equals a full decode (byte-level BPE, SentencePiece
byte fallback, raw bytes), and stop strings cut a delta stream exactly once."""

from __future__ import annotations

import json
import os
import random
from pydoc_data.topics import topics

import pytest
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as BackendTokenizer

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.output_processor import TextStream
from engine.protocol import FinishReason, RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer, byte_tokenizer

TOPIC_TEXTS = list(topics.values())
UNICODE_TEXTS = [
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 ✨ end",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "naïve café Ωmega — “quotes” … ½ ß",
    "😀",
    "  leading spaces, then 🐍 and 漢字 at the end 🎉",
    "Hello world",
    "line one\n\n  line two\ttab",
]


def detokenize(
    tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool, step: int = 1
) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens)
    deltas = [detokenizer.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas


def assert_incremental_equals_full(tokenizer: Tokenizer, ids: list[int]) -> None:
    for skip in (True, False):
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        for step in (1, 3):
            deltas = detokenize(tokenizer, ids, skip, step)
            assert "".join(deltas) == full
            if "\ufffd" not in full:
                assert not any("\ufffd" in delta for delta in deltas)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: str) -> Tokenizer:
    return Tokenizer.from_gguf(os.path.join(smollm2_dir, "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    """Llama-2 style: normalizer prepends "▁", BPE with `<0xNN>` byte fallback, no pre-split."""
    trained = BackendTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False, limit_alphabet=100)
    trained.train_from_iterator(TOPIC_TEXTS[:40], trainer)
    model = json.loads(trained.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    vocab |= {piece: 259 + i for piece, i in model["vocab"].items()}
    merges = [tuple(merge) for merge in model["merges"]]
    backend = BackendTokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return Tokenizer(backend, bos_token_id=1, eos_token_id=2)


# IncrementalDetokenizer
@pytest.mark.parametrize("start", range(0, len(TOPIC_TEXTS), 20))
def test_smollm2_topics(smollm2: Tokenizer, start: int) -> None:
    for text in TOPIC_TEXTS[start : start + 20]:
        assert_incremental_equals_full(smollm2, smollm2.encode(text[:3000]))


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_smollm2_unicode_and_specials(smollm2: Tokenizer, text: str) -> None:
    assert_incremental_equals_full(smollm2, smollm2.encode(text))
    chat = smollm2.encode_chat(
        [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
    )
    assert_incremental_equals_full(smollm2, chat)


def test_smollm2_emoji_is_held_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("a😀b")
    deltas = detokenize(smollm2, ids, skip_special_tokens=True)
    assert len(ids) > 3  # the emoji takes several byte tokens
    assert [d for d in deltas if d] == ["a", "😀", "b"]
    assert "" in deltas[:-1]


@pytest.mark.parametrize("text", [*UNICODE_TEXTS, *TOPIC_TEXTS[40:44]])
def test_sentencepiece_byte_fallback(sentencepiece: Tokenizer, text: str) -> None:
    ids = sentencepiece.encode(text)
    assert ids[0] == 1
    assert_incremental_equals_full(sentencepiece, ids)
    assert_incremental_equals_full(sentencepiece, [*ids[1:], 2, *ids[1:]])


def test_sentencepiece_uses_byte_tokens_and_leading_space(sentencepiece: Tokenizer) -> None:
    ids = sentencepiece.encode("the 漢 is", add_special_tokens=False)
    pieces = sentencepiece.convert_ids_to_tokens(ids)
    assert sum(piece.startswith("<0x") for piece in pieces) == 3
    deltas = detokenize(sentencepiece, ids, skip_special_tokens=True)
    assert deltas[0] == "the"  # the first token's "▁" is stripped, as in a full decode
    assert [d for d in deltas if d][1:] == [" ", "漢", " is"]


def test_special_token_between_words(sentencepiece: Tokenizer) -> None:
    hello, world = (sentencepiece.encode(w, add_special_tokens=False) for w in ("hello", "world"))
    ids = [*hello, 2, *world, 1, *hello]
    assert "".join(detokenize(sentencepiece, ids, True)) == "hello world hello"
    assert "".join(detokenize(sentencepiece, ids, False)) == sentencepiece.decode(ids, False)


def test_byte_tokenizer_splits_every_character() -> None:
    tokenizer = byte_tokenizer(300)
    for text in UNICODE_TEXTS:
        assert_incremental_equals_full(tokenizer, tokenizer.encode(text))


def test_flush_emits_incomplete_tail_like_full_decode() -> None:
    tokenizer = byte_tokenizer(300)
    ids = tokenizer.encode("ok 😀")[:-2]
    detokenizer = IncrementalDetokenizer(tokenizer, None)
    assert "".join(detokenizer.add([i]) for i in ids) == "ok "
    tail = detokenizer.flush()
    assert tail.startswith("\ufffd")
    assert detokenizer.text == tokenizer.decode(ids)
    assert detokenizer.flush() == ""


def test_random_token_streams_decode_consistently(smollm2: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randrange(1, 60))]
        for skip in (True, False):
            assert "".join(detokenize(smollm2, ids, skip)) == smollm2.decode(ids, skip)


# StopStringMatcher
def expected_output(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """The rule on the whole text: cut at the occurrence that ends first (then starts first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, False
    end, start, _ = min(found)
    return text[: end if include else start], True


def run_matcher(deltas: list[str], stops: list[str], include: bool) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops, include)
    emitted: list[str] = []
    for delta in deltas:
        out, matched = matcher.feed(delta)
        emitted.append(out)
        if matched is not None:
            assert matched == matcher.matched
            assert matched in stops
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_stop_string_spanning_deltas() -> None:
    emitted, matched = run_matcher(["Hello ST", "O", "P and more"], ["STOP"], False)
    assert matched
    assert emitted == ["Hello ", "", ""]
    emitted, matched = run_matcher(["Hello ST", "O", "P and more"], ["STOP"], True)
    assert emitted == ["Hello ", "", "STOP"]


def test_earliest_stop_wins() -> None:
    assert run_matcher(["a b END c STOP"], ["STOP", "END"], False) == (["a b "], True)
    assert run_matcher(["xab", "c"], ["abc", "xab"], True) == (["xab"], True)
    assert run_matcher(["xa", "bc"], ["b", "xabc"], False) == (["", "xa"], True)


def test_no_hold_on_unrelated_text() -> None:
    matcher = StopStringMatcher(["<|stop|>", "###"], False)
    assert matcher.feed("plain text, no markers") == ("plain text, no markers", None)
    assert matcher.feed("ends with <|st") == ("ends with ", None)
    assert matcher.feed("art|> ok #") == ("<|start|> ok ", None)
    assert matcher.feed("#") == ("", None)
    assert matcher.flush() == "##"
    assert matcher.flush() == ""


def test_after_match_nothing_more_is_emitted() -> None:
    matcher = StopStringMatcher(["\n\n"], True)
    assert matcher.feed("one\n") == ("one", None)
    assert matcher.feed("\ntwo") == ("\n\n", "\n\n")
    assert matcher.matched == "\n\n"
    assert matcher.feed("three") == ("", "\n\n")
    assert matcher.flush() == ""


def test_no_stop_strings_passes_through() -> None:
    matcher = StopStringMatcher(["", ""], False)
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_random_splits_match_whole_text_rule(include: bool) -> None:
    rng = random.Random(1234)
    alphabet = "ab c😀"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in "xyz"]
        stops = stops[: rng.randrange(1, 4)]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        emitted, matched = run_matcher(deltas, stops, include)
        assert ("".join(emitted), matched) == expected_output(text, stops, include)
        longest = max(len(s) for s in stops)
        for i, _ in enumerate(emitted[:-1]):
            so_far = "".join(deltas[: i + 1])
            assert len(so_far) - len("".join(emitted[: i + 1])) <= longest - 1


# TextStream: outputs of several tokens (accepted speculative drafts)
def test_a_stop_string_within_a_multi_token_output_drops_the_tokens_after_it(
    smollm2: Tokenizer,
) -> None:
    ids = smollm2.encode(" one two three four five six")
    assert len(ids) == 6
    params = SamplingParams(stop=("three",), max_tokens=16)
    stream = TextStream(smollm2, [1], params)
    first = stream.process(
        RequestOutput(request_id="r", new_token_ids=ids[:1], num_output_tokens=1)
    )
    assert first.text == " one" and not first.finished
    # five tokens at once: the stop string ends in the second of them
    delta = stream.process(
        RequestOutput(request_id="r", new_token_ids=ids[1:], num_output_tokens=6)
    )
    assert delta.finished and delta.stop_reason == "three"
    assert delta.text == " two "
    assert delta.token_ids == ids[1:3] and delta.num_output_tokens == 3
    assert stream.token_ids == ids[:3]


def test_a_multi_token_output_without_a_stop_string_is_read_whole(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(" one two three")
    for stop in ((), ("never",)):
        stream = TextStream(smollm2, [1], SamplingParams(stop=stop, max_tokens=16))
        out = RequestOutput(
            request_id="r",
            new_token_ids=ids,
            num_output_tokens=len(ids),
            finish_reason=FinishReason.LENGTH,
        )
        delta = stream.process(out)
        assert delta.text == " one two three" and delta.token_ids == ids
        assert delta.finish_reason is FinishReason.LENGTH and delta.num_output_tokens == len(ids)
