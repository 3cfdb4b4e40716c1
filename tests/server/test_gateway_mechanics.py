"""Gateway mechanics on a tiny random model (starts in seconds): errors, auth, admission,
cancellation, metrics, external workers, fingerprint refusal, a worker dying mid-stream."""

import json
import signal
import time

import httpx
import openai
import pytest

from tests.server.serverproc import (
    ServerProcess,
    free_port,
    make_tiny_model_with_tokenizer,
    metric,
    metric_samples,
)

KEY = "sk-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer):
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny") / "model",
                                          smollm2_tokenizer)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = ServerProcess(["--model", str(tiny_model), "--mode", "colocated",
                         "--dtype", "float32", "--api-key", KEY,
                         "--served-model-name", "tiny", "--max-num-seqs", "2",
                         "--max-queued-requests", "1", "--num-kv-blocks", "160"],
                        tmp_path_factory.mktemp("srv") / "serve.log")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()
    assert srv.children_alive() == []


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def blocks_used(url: str) -> int:
    return sum(w["kv_blocks_used"] for w in httpx.get(url + "/health").json()["workers"])


def wait_blocks_zero(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health").json()
        if all(w["kv_blocks_used"] == 0 and w["running"] == 0 and w["waiting"] == 0
               for w in h["workers"]):
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks not freed: {h}")


def ok_request(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_auth(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # not behind the key
    assert httpx.get(server.url + "/version").json()["version"]
    ok_request(client)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    ({}, "prompt"),
])
def test_invalid_completion_params_are_400(server, client, body, param):
    r = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok_request(client)


def test_errors_through_the_openai_client(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       temperature=5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard",
                                                                "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hello world", max_tokens=5000)
    msg = e.value.body["message"]
    assert "2048" in msg and "5000" in msg and "5002" in msg  # limit, asked, total
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={**HEADERS, "content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS,
                   content=b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}')
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/nothing", json={}, headers=HEADERS)
    assert r.status_code == 404 and "error" in r.json()
    # unknown fields are accepted and ignored, as OpenAI clients expect
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS,
                   json={"prompt": "x", "max_tokens": 2, "some_future_field": {"a": 1}})
    assert r.status_code == 200
    ok_request(client)


def test_queue_full_is_429_then_disconnects_free_blocks(server, client):
    # capacity: max_num_seqs 2 + 1 queued = 3 requests in flight
    http = httpx.Client(base_url=server.url, headers=HEADERS, timeout=60)
    body = {"prompt": "go", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    streams = []
    for i in range(3):
        cm = http.stream("POST", "/v1/completions", json=body)
        resp = cm.__enter__()
        assert resp.status_code == 200
        lines = resp.iter_lines()
        if i < 2:  # the third waits on the worker for a free running slot
            next(line for line in lines if line.startswith("data:"))
        streams.append((cm, lines))
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.body["code"] == "queue_full"
    assert blocks_used(server.url) > 0
    before = metric_samples(server.url)
    for cm, _ in streams:  # clients drop mid-stream
        cm.__exit__(None, None, None)
    wait_blocks_zero(server.url)
    after = metric_samples(server.url)
    aborted = (metric(after, "splitserve_request_success_total", finished_reason="abort")
               - metric(before, "splitserve_request_success_total", finished_reason="abort"))
    assert aborted == 3
    ok_request(client)


def test_non_streaming_disconnect_frees_blocks(server, client):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=1.0,
                   json={"prompt": "go", "max_tokens": 1900, "ignore_eos": True})
    wait_blocks_zero(server.url)
    ok_request(client)


def test_histogram_counts_equal_requests_served(server, client):
    before = metric_samples(server.url)
    usages = []
    for i in range(3):
        r = client.completions.create(model="tiny", prompt=f"number {i}", max_tokens=4 + i,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage)
    for i in range(2):
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=5,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usages.append([c.usage for c in stream if c.usage][0])
    after = metric_samples(server.url)

    def delta(name, **lb):
        return metric(after, name, **lb) - metric(before, name, **lb)

    for h in ("request_queue_time_seconds", "time_to_first_token_seconds",
              "e2e_request_latency_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens"):
        assert delta(f"splitserve_{h}_count", model_name="tiny") == 5, h
    gen = sum(u.completion_tokens for u in usages)
    assert delta("splitserve_inter_token_latency_seconds_count") == gen - 5
    assert delta("splitserve_generation_tokens_total") == gen
    assert delta("splitserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("splitserve_request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("splitserve_request_success_total", finished_reason="length") == 5
    assert metric(after, "splitserve_kv_cache_blocks_total") == 160
    assert metric(after, "splitserve_kv_cache_bytes_per_token") == 2 * 2 * 2 * 16 * 4
    assert metric(after, "splitserve_kv_cache_usage_ratio") == 0
    assert metric(after, "splitserve_num_requests_running", role="colocated") == 0
    assert metric(after, "splitserve_workers", role="colocated") == 1
    for name in ("splitserve_num_preemptions_total", "splitserve_num_requests_waiting"):
        assert any(n == name for n, _ in after), name


def test_external_workers_refusal_and_worker_death(tiny_model, tmp_path):
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    gw = ServerProcess(["--model", str(tiny_model), "--mode", "colocated", "--num-workers", "0",
                        "--scheduler-port", str(port), "--worker-timeout", "2"],
                       tmp_path / "gw.log", ready_status=503)
    url = gw.url
    workers = []
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:  # 503: no worker yet
            client.completions.create(model="model", prompt="x")
        assert e.value.status_code == 503

        def start_worker(name, *extra):
            w = ServerProcess(["--scheduler", addr, "--worker-id", name, "--model",
                               str(tiny_model), "--dtype", "float32", "--num-kv-blocks", "160",
                               *extra], tmp_path / f"{name}.log", command="worker")
            workers.append(w)
            return w

        w1 = start_worker("w1")
        gw.wait_ready(200, 120)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="hi", max_tokens=3).choices

        bad = start_worker("w-bad", "--block-size", "8")
        assert bad.proc.wait(timeout=120) != 0
        refused = httpx.get(url + "/health").json()["refused_workers"]
        assert "block_size" in refused["w-bad"]
        assert "refused" in bad.log()
        assert client.completions.create(model=model, prompt="hi", max_tokens=3).choices

        # the worker dies mid-stream: the stream ends with an error event, nothing hangs
        stream = client.completions.create(model=model, prompt="go", max_tokens=1900,
                                           stream=True, extra_body={"ignore_eos": True})
        got = 0
        with pytest.raises(openai.APIError, match="went away"):
            for _ in stream:
                got += 1
                if got == 3:
                    w1.proc.send_signal(signal.SIGKILL)
        assert got >= 3
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["workers"] == []

        start_worker("w2")
        gw.wait_ready(200, 120)
        r = client.completions.create(model=model, prompt="hi", max_tokens=3)
        assert r.choices[0].finish_reason in ("stop", "length")
        wait_blocks_zero(url)
        raw = httpx.get(url + "/metrics").text
        assert 'splitserve_request_errors_total{model_name="' in raw
        assert json.loads(httpx.get(url + "/health").text)["status"] == "ok"
    finally:
        gw.stop()
        for w in workers:
            w.stop()
    for w in workers:
        assert w.proc.poll() is not None
