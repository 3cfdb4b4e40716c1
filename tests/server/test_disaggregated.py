"""Disaggregated prefill/decode pools on a tiny random model: outputs identical to colocated
and to the in-process engine, load across 2P+2D, fingerprint refusal, a prefill worker
dying while it holds a reservation, and gateway/workers in separate network namespaces."""

import concurrent.futures as cf
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from scheduler.sampling_params import SamplingParams
from tests.conftest import track
from tests.server.serverproc import (
    ROOT,
    ServerProcess,
    free_port,
    make_tiny_model_with_tokenizer,
    metric,
    metric_samples,
)
from workers.engine import EngineConfig, LLMEngine

ENGINE = ["--dtype", "float32", "--num-kv-blocks", "400", "--max-num-seqs", "64"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer):
    # max_pos 4096: room for 2,048-token prompts
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tinyd") / "tiny",
                                          smollm2_tokenizer, max_pos=4096)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return track(LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32",
                                        num_kv_blocks=400)))


def prompts_of(lengths, seed=0):
    import random

    rnd = random.Random(seed)
    return [[rnd.randrange(100, 40000) for _ in range(n)] for n in lengths]


def complete(url, prompt, n_out):
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n_out, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()


def engine_text(reference, tokenizer, prompt, n_out):
    ids = reference.generate([prompt], SamplingParams(max_tokens=n_out, temperature=0,
                                                      ignore_eos=True))[0]
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def health(url):
    return httpx.get(url + "/health", timeout=10).json()


def wait_idle(url, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = health(url)
        if h["workers"] and all(w["kv_blocks_used"] == 0 and w["running"] == 0
                                and w["waiting"] == 0 for w in h["workers"]):
            return h
        time.sleep(0.1)
    raise AssertionError(f"not idle: {h}")


def test_disaggregated_equals_colocated_and_engine(tiny_model, reference, smollm2_tokenizer,
                                                   tmp_path):
    prompts = prompts_of([5, 37, 300, 2048])
    outs = {}
    for mode in ("disaggregated", "colocated"):
        srv = ServerProcess(["--model", str(tiny_model), "--served-model-name", "tiny",
                             "--mode", mode, *ENGINE], tmp_path / f"{mode}.log")
        try:
            outs[mode] = [complete(srv.url, p, 24)["choices"][0]["text"] for p in prompts]
            # a seeded sampled request continues on the decode worker exactly as it would
            # have on one worker (its generator skips the draw the prefill worker used)
            outs[mode].append(httpx.post(srv.url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": prompts[1], "max_tokens": 16, "temperature": 1.0,
                "seed": 1234, "ignore_eos": True}).json()["choices"][0]["text"])
            if mode == "disaggregated":
                h = wait_idle(srv.url)
                assert sorted(w["role"] for w in h["workers"]) == ["decode", "prefill"]
                m = metric_samples(srv.url)
                # whole blocks of 16 tokens x (K,V x 2 layers x 2 KV heads x 16 dims x 4 bytes)
                sent = [*prompts, prompts[1]]  # the seeded request is the fifth transfer
                blocks = sum(-(-len(p) // 16) for p in sent)
                assert metric(m, "splitserve_kv_transfer_bytes_total") == blocks * 16 * 512
                assert metric(m, "splitserve_kv_transfer_seconds_count") == 5
                assert metric(m, "splitserve_kv_transfer_failures_total") == 0
        finally:
            srv.stop()
    for i, p in enumerate(prompts):
        text, _ = engine_text(reference, smollm2_tokenizer, p, 24)
        assert outs["disaggregated"][i] == outs["colocated"][i] == text, f"prompt {i}"
    assert outs["disaggregated"][-1] == outs["colocated"][-1]
    assert outs["disaggregated"][-1] != outs["disaggregated"][1][:len(outs["disaggregated"][-1])]


def test_two_by_two_pools_under_load(tiny_model, reference, smollm2_tokenizer, tmp_path):
    srv = ServerProcess(["--model", str(tiny_model), "--served-model-name", "tiny",
                         "--prefill-workers", "2", "--decode-workers", "2",
                         "--local-prefill-max-tokens", "8", *ENGINE], tmp_path / "2x2.log")
    try:
        lengths = [3 + (i * 37) % 400 for i in range(64)]
        prompts = prompts_of(lengths, seed=1)
        n_out = [4 + i % 13 for i in range(64)]
        with cf.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda a: complete(srv.url, *a), zip(prompts, n_out)))
        for p, n, r in zip(prompts, n_out, results):
            assert r["usage"]["completion_tokens"] == n
            assert r["choices"][0]["text"] == engine_text(reference, smollm2_tokenizer, p, n)[0]
        h = wait_idle(srv.url)
        assert len(h["workers"]) == 4
        assert all(w["steps"] > 0 for w in h["workers"]), h  # every worker served some
        m = metric_samples(srv.url)
        transfers = sum(1 for n in lengths if n >= 8)
        assert metric(m, "splitserve_kv_transfer_seconds_count") == transfers
        assert metric(m, "splitserve_kv_cache_blocks_used") == 0
    finally:
        srv.stop()


def test_fingerprint_mismatch_refused_and_prefill_death_retried(tiny_model, reference,
                                                                smollm2_tokenizer, tmp_path):
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    gw = ServerProcess(["--model", str(tiny_model), "--served-model-name", "tiny",
                        "--prefill-workers", "0", "--decode-workers", "0",
                        "--scheduler-port", str(port), "--worker-timeout", "2"],
                       tmp_path / "gw.log", ready_status=503)
    workers = {}

    def worker(name, role, *extra):
        w = ServerProcess(["--scheduler", addr, "--worker-id", name, "--role", role,
                           "--model", str(tiny_model), *ENGINE, *extra],
                          tmp_path / f"{name}.log", command="worker")
        workers[name] = w
        return w

    try:
        worker("d1", "decode")
        # p1 prefills in 32-token chunks: slow enough to be killed mid-prefill
        worker("p1", "prefill", "--max-num-batched-tokens", "32", "--num-threads", "1")
        gw.wait_ready(200, 120)
        deadline = time.monotonic() + 60
        while len(health(gw.url)["workers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        bad = worker("d-bad", "decode", "--dtype", "bfloat16")
        assert bad.proc.wait(timeout=120) != 0
        assert "dtype" in health(gw.url)["refused_workers"]["d-bad"]

        prompt = prompts_of([2048], seed=5)[0]
        expected, _ = engine_text(reference, smollm2_tokenizer, prompt, 8)
        # only one prefill worker, frozen then killed while the decode worker holds the
        # reservation: the request fails cleanly (503, saying why)
        workers["p1"].proc.send_signal(signal.SIGSTOP)
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, gw.url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            time.sleep(0.5)
            workers["p1"].proc.send_signal(signal.SIGKILL)
            r = fut.result()
        assert r.status_code == 503, r.text
        assert "prefill" in r.json()["error"]["message"]
        wait_idle(gw.url)  # the decode worker's reservation was released

        # two prefill workers, the one chosen dies: the request is retried on the other
        worker("p2", "prefill", "--max-num-batched-tokens", "32", "--num-threads", "1")
        worker("p3", "prefill")
        while len(health(gw.url)["workers"]) < 3 and time.monotonic() < deadline + 60:
            time.sleep(0.2)
        workers["p2"].proc.send_signal(signal.SIGSTOP)  # p2 sorts first on a tie
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, gw.url, prompt, 8)
            time.sleep(0.5)
            reserved = [w["kv_blocks_reserved"] for w in health(gw.url)["workers"]
                        if w["role"] == "decode"]
            assert reserved == [2048 // 16 + 1]  # prompt + first token, held for p2's KV
            workers["p2"].proc.send_signal(signal.SIGKILL)
            r = fut.result()
        assert r["choices"][0]["text"] == expected
        m = metric_samples(gw.url)
        assert metric(m, "splitserve_kv_transfer_retries_total") == 1
        wait_idle(gw.url)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=4).choices
    finally:
        gw.stop()
        for w in workers.values():
            w.stop()


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.fixture
def netns():
    """Three network namespaces (gateway, prefill, decode) on a bridge in this namespace."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"ss{os.getpid() % 100000}"
    names = {role: f"{tag}{role[0]}" for role in ("gateway", "prefill", "decode")}
    bridge = f"{tag}br"
    r = _sh("ip", "netns", "add", names["gateway"])
    if r.returncode != 0:
        pytest.skip(f"this machine refuses network namespaces: {r.stderr.strip()}")
    try:
        for ns in list(names.values())[1:]:
            assert _sh("ip", "netns", "add", ns).returncode == 0
        assert _sh("ip", "link", "add", bridge, "type", "bridge").returncode == 0
        _sh("ip", "addr", "add", "10.213.7.254/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        ips = {}
        for i, (role, ns) in enumerate(names.items(), start=1):
            host, peer = f"{ns}h", f"{ns}p"
            assert _sh("ip", "link", "add", host, "type", "veth", "peer", "name",
                       peer).returncode == 0
            _sh("ip", "link", "set", host, "master", bridge)
            _sh("ip", "link", "set", host, "up")
            _sh("ip", "link", "set", peer, "netns", ns)
            ips[role] = f"10.213.7.{i}"
            for cmd in (["ip", "addr", "add", f"{ips[role]}/24", "dev", peer],
                        ["ip", "link", "set", peer, "up"], ["ip", "link", "set", "lo", "up"]):
                assert _sh("ip", "netns", "exec", ns, *cmd).returncode == 0
        yield names, ips
    finally:
        for ns in names.values():
            _sh("ip", "netns", "del", ns)
        _sh("ip", "link", "del", bridge)


def test_cross_host_over_tcp(netns, tiny_model, reference, smollm2_tokenizer, tmp_path):
    names, ips = netns
    http_port, sched_port = free_port(), free_port()
    base = [sys.executable, "-m", "server.cli", "--log-level", "INFO"]
    procs = []

    def start(ns, args, log):
        f = open(tmp_path / log, "wb")
        p = subprocess.Popen(["ip", "netns", "exec", ns, *base, *args], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        start(names["gateway"], ["serve", "--host", ips["gateway"], "--port", str(http_port),
                                 "--model", str(tiny_model), "--served-model-name", "tiny",
                                 "--prefill-workers", "0", "--decode-workers", "0",
                                 "--scheduler-host", ips["gateway"],
                                 "--scheduler-port", str(sched_port)], "gw.log")
        sched = f"tcp://{ips['gateway']}:{sched_port}"
        start(names["decode"], ["worker", "--role", "decode", "--scheduler", sched,
                                "--kv-host", ips["decode"], "--model", str(tiny_model),
                                *ENGINE], "d.log")
        start(names["prefill"], ["worker", "--role", "prefill", "--scheduler", sched,
                                 "--model", str(tiny_model), *ENGINE], "p.log")
        url = f"http://{ips['gateway']}:{http_port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                h = httpx.get(url + "/health", timeout=2).json()
                if len(h.get("workers", [])) == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            logs = "\n".join((tmp_path / n).read_text()[-2000:] for n in ("gw.log", "d.log",
                                                                          "p.log"))
            raise AssertionError(f"cross-host system did not come up:\n{logs}")
        kv = [w for w in h["workers"] if w["role"] == "decode"][0]
        assert kv["kv_endpoint"].startswith(f"tcp://{ips['decode']}:")
        for p in prompts_of([40, 700], seed=9):
            got = complete(url, p, 12)["choices"][0]["text"]
            assert got == engine_text(reference, smollm2_tokenizer, p, 12)[0]
        m = metric_samples(url)
        assert metric(m, "splitserve_kv_transfer_seconds_count") == 2
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
