"""The official `openai` client against a real `splitserve serve` on the default model."""

import asyncio
import signal

import httpx
import openai
import pytest

from scheduler.sampling_params import SamplingParams
from server.tokenizer import chat_prompt_ids
from tests.server.serverproc import ServerProcess, metric, metric_samples

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "256MiB",
                         "--max-num-seqs", "48"], tmp_path_factory.mktemp("srv") / "serve.log")
    yield srv
    # uvicorn re-raises SIGTERM after a graceful shutdown, so -SIGTERM is a clean exit here
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()
    assert "shutdown asked: gateway shutting down" in srv.log()
    assert srv.children_alive() == [], "worker processes outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_endpoint(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]


def test_chat_greedy_equals_in_process_engine(client, smollm2_engine, smollm2_tokenizer):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=40, temperature=0)
    prompt = chat_prompt_ids(smollm2_tokenizer, [{"role": "user", "content": QUESTION}])
    tokens = smollm2_engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert r.choices[0].message.content == smollm2_tokenizer.decode(
        tokens, skip_special_tokens=True)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] == 2 else "length")
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == len(prompt) + len(tokens)


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model="smollm2", max_tokens=32, temperature=0)
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    full = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(messages=msgs, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full and finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0

    prompt = "The three primary colors are"
    text = client.completions.create(prompt=prompt, **kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(prompt=prompt, stream=True, **kw)
                       if c.choices)
    assert streamed == text and len(text) > 10


def test_chat_stream_helper(client):
    with client.chat.completions.stream(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=20, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content
    assert "Paris" in final.choices[0].message.content


def test_n_choices_with_seed_are_reproducible(client):
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me a short story."}],
              max_tokens=16, temperature=1.0, n=3, seed=42)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice has its own seed
    assert a.usage.completion_tokens <= 48


def test_logprobs_and_stop_strings(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 8 and "".join(lp.tokens) == r.choices[0].text
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) == 3 and max(top.values()) == pytest.approx(val)
    text = r.choices[0].text
    cut = text.strip().split()[1]  # a word from the middle of the greedy answer
    s = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=8, temperature=0, stop=[cut])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == text[:text.index(cut)]

    c = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(x.top_logprobs) == 2 for x in content)


async def test_async_client_32_concurrent_streams(aclient, server, smollm2_tokenizer):
    before = metric_samples(server.url)

    async def one(i):
        msgs = [{"role": "user", "content": f"Count from {i} to {i + 5}."}]
        text, usage = [], None
        stream = await aclient.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text.append(c.delta.content or "")
        return msgs, "".join(text), usage

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 300)
    for msgs, text, usage in results:
        assert usage.completion_tokens == 12
        assert usage.prompt_tokens == len(chat_prompt_ids(smollm2_tokenizer, msgs))
        assert text
    after = metric_samples(server.url)
    served = (metric(after, "splitserve_e2e_request_latency_seconds_count")
              - metric(before, "splitserve_e2e_request_latency_seconds_count"))
    assert served == 32
    assert (metric(after, "splitserve_generation_tokens_total")
            - metric(before, "splitserve_generation_tokens_total")) == 32 * 12
    assert metric(after, "splitserve_kv_cache_blocks_used") == 0


def test_long_prompt_through_disaggregated_pools_equals_engine(client, server, smollm2_engine,
                                                               smollm2_tokenizer):
    import random

    rnd = random.Random(7)
    prompt = [rnd.randrange(100, 49000) for _ in range(2048)]
    health = httpx.get(server.url + "/health").json()
    assert sorted(w["role"] for w in health["workers"]) == ["decode", "prefill"]
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = smollm2_engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                           ignore_eos=True))[0]
    assert r.choices[0].text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == 2048 and r.usage.completion_tokens == 12
    m = metric_samples(server.url)
    assert metric(m, "splitserve_kv_transfer_bytes_total") > 2048 * 46_080  # float32 KV
