"""The official OpenAI SDK, unchanged, against the real gateway over real HTTP, with the real
default model behind it."""

from __future__ import annotations

import time
from pydoc_data.topics import topics

import httpx
import openai
import pytest

from tests.integration.conftest import ADMIN_TOKEN

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tenant(gateway):
    return gateway.new_tenant(rpm=1000, tpm=1_000_000, max_concurrent=64)


@pytest.fixture
def client(gateway, tenant):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=tenant[1], max_retries=0)


def test_chat_non_streaming(client, gateway):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0
    )
    reply = raw.parse()
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.id.startswith("chatcmpl-")
    assert raw.headers["x-request-id"] == reply.id
    assert reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert raw.headers["x-ratelimit-limit-requests"] == "1000"
    assert int(raw.headers["x-ratelimit-remaining-requests"]) < 1000


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    # exact counts: the same request non-streamed reports the same usage
    again = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0
    )
    assert usage.prompt_tokens == again.usage.prompt_tokens
    assert usage.completion_tokens == again.usage.completion_tokens
    assert again.choices[0].message.content == text


def test_completions_both_ways(client):
    done = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert done.object == "text_completion"
    assert done.id.startswith("cmpl-")
    assert done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"
    streamed = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_sampling_options_and_n(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=12,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        n=3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        user="end-user-42",
    )
    assert len(reply.choices) == 3
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 3 * 12
    same_seed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0.8, top_p=0.9, seed=7
    )
    again = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0.8, top_p=0.9, seed=7
    )
    assert same_seed.choices[0].message.content == again.choices[0].message.content

    # a seeded request's n choices differ from each other, and repeat as a set
    def texts(n: int) -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.2, seed=11, n=n
        )
        return [c.message.content for c in reply.choices]

    three = texts(3)
    assert len(set(three)) > 1
    assert three == texts(3) and three[0] == texts(1)[0]


def test_n_choices_compute_their_prompt_once(client):
    # a fresh prompt of 20 blocks: the other three choices take its KV from the prefix cache
    document = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(30))
    prompt = f"{document}\nSummary ({time.time()}):"

    def create(prompt: str, **extra):
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0.9, seed=3, n=4, **extra
        )

    for stream in (False, True):
        if stream:
            chunks = list(create(prompt, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2, 3}
        else:
            reply = create(prompt)
            usage = reply.usage
            assert len(reply.choices) == 4
        assert usage.prompt_tokens > 320
        # the best choice's hits count once: the whole prompt but its last partial block
        assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 32, stream
        prompt += " again"


def test_stop_and_logprobs(client):
    full = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=20, temperature=0
    )
    text = full.choices[0].message.content
    stop = text.split()[2]
    cut = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # which stop ended it, as vLLM reports it (null for the end of turn)
    assert cut.choices[0].stop_reason == stop and full.choices[0].stop_reason is None
    streamed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, stop=[stop], stream=True
    )
    last = [c.choices[0] for c in streamed if c.choices][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    lp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert all(item.logprob <= 0 for item in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)


def test_echo_scores_the_prompt_as_lm_eval_asks(client, smollm2_tokenizer):
    context = smollm2_tokenizer.encode("The capital of France is")
    greedy = client.completions.create(
        model=MODEL, prompt=context, max_tokens=4, temperature=0, logprobs=1
    )
    continuation = greedy.choices[0].logprobs
    ids = context + [smollm2_tokenizer.encode(t)[0] for t in continuation.tokens]
    # lm-eval's loglikelihood request: the whole text, nothing generated, echoed with scores
    scored = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    assert choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text == smollm2_tokenizer.decode(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    tail = lp.token_logprobs[len(context) :]
    assert tail == pytest.approx(continuation.token_logprobs, abs=1e-2)
    # greedy tokens are their position's top choice (lm-eval's is_greedy)
    for token, top in zip(lp.tokens[len(context) :], lp.top_logprobs[len(context) :], strict=True):
        assert max(top, key=top.get) == token
    # streamed: the echoed prompt and its scores come first, then the generated tokens
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=2, echo=True, logprobs=1, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == choice.text and first.logprobs.tokens == lp.tokens
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    rest = [c.choices[0] for c in chunks[1:] if c.choices and c.choices[0].text]
    assert sum(len(c.logprobs.tokens) for c in rest) == 2
    # echo alone: the prompt comes back, without scores
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_a_batch_of_prompts_answers_each_in_order(client, smollm2_tokenizer):
    texts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    alone = [
        client.completions.create(model=MODEL, prompt=t, max_tokens=6, temperature=0) for t in texts
    ]
    batch = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in "xy"]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=texts, max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    # token-id prompts in a batch, echoed and scored (lm-eval sends its batches this way)
    ids = [smollm2_tokenizer.encode(t) for t in texts]
    scored = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    for choice, prompt in zip(scored.choices, ids, strict=True):
        assert len(choice.logprobs.tokens) == len(prompt)
        assert choice.text == smollm2_tokenizer.decode(prompt)
        assert all(lp < 0 for lp in choice.logprobs.token_logprobs[1:])


def test_logit_bias_and_min_tokens(client, smollm2_tokenizer):
    prompt = "The capital of France is"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    winner = smollm2_tokenizer.encode(first.choices[0].text)[0]
    banned = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(winner): -100}
    )
    assert banned.choices[0].text not in ("", first.choices[0].text)
    forced = smollm2_tokenizer.encode(" banana")[0]
    steered = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(forced): 100}
    )
    assert steered.choices[0].text == smollm2_tokenizer.decode([forced])
    # the answer usually ends after a few tokens; min_tokens holds back the end of turn
    short = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, temperature=0
    )
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30
    longer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, temperature=0, extra_body={"min_tokens": 30}
    )
    assert longer.usage.completion_tokens >= 30
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)


def test_models_lists_the_base_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len >= 2048  # an extra field the SDK keeps
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_sdk_errors_are_typed(client, gateway):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert err.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-strata-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=QUESTION)


def test_schema_and_ops_endpoints(gateway):
    with httpx.Client(base_url=gateway.url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        ready = http.get("/ready")
        assert ready.status_code == 200
        assert ready.json()["engine"] is True
        schema = http.get("/schema/openapi.json")
        assert schema.status_code == 200
        assert "/v1/chat/completions" in schema.json()["paths"]
        metrics = http.get("/metrics").text
        assert "strata:request_success_total" in metrics
        assert "strata:kv_blocks_capacity" in metrics
        per_token = next(
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("strata:kv_cache_bytes_per_token{")
        )
        assert per_token > 0 and per_token % 2 == 0  # K and V of every layer
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as admin:
        assert admin.get("/admin/tenants/").status_code == 200


def test_tokenize_and_detokenize(client, gateway, tenant, smollm2_tokenizer):
    text = "The capital of France is"
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {tenant[1]}"}
    ) as http:
        got = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
        assert got["tokens"] == smollm2_tokenizer.encode(text) and got["count"] == len(
            got["tokens"]
        )
        assert got["max_model_len"] >= 2048
        # messages count exactly as a chat request bills them
        chat = http.post("/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
        assert chat["count"] == reply.usage.prompt_tokens
        back = http.post("/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()
        assert back["prompt"].startswith("<|im_start|>") and "capital of France" in back["prompt"]
        for path, body, param in [
            ("/tokenize", {"model": MODEL}, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": "a", "messages": QUESTION}, "prompt"),
            ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
            ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, "tokens"),
        ]:
            bad = http.post(path, json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        unknown = http.post("/tokenize", json={"model": "gpt-9", "prompt": "a"})
        assert unknown.status_code in (400, 404)
    assert (
        httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL, "prompt": "a"}).status_code
        == 401
    )


def test_a_quoting_answer_is_decoded_with_accepted_drafts(client, gateway):
    """The shared worker drafts for greedy requests (--speculative-tokens 4)."""

    def counts() -> tuple[float, float]:
        lines = httpx.get(f"{gateway.url}/metrics").text.splitlines()
        value = {line.split()[0]: float(line.split()[1]) for line in lines if line[:1] != "#"}
        of_worker = f'{{worker="{gateway.settings.engine_addresses[0]}"}}'
        return (
            value[f"strata:spec_decode_num_draft_tokens_total{of_worker}"],
            value[f"strata:spec_decode_num_accepted_tokens_total{of_worker}"],
        )

    drafts_before, accepted_before = counts()
    document = topics["assert"][:1500]
    ask = f"{document}\n\nQuote the first sentence of the text above exactly."
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=40, temperature=0
    )
    answer = reply.choices[0].message.content
    assert answer and "debugging assertions" in answer  # copied from the document
    drafts, accepted = counts()
    assert drafts - drafts_before >= accepted - accepted_before > 5
    assert reply.usage is not None and reply.usage.completion_tokens <= 40
