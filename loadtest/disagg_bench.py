"""Colocated vs disaggregated (1 prefill + 1 decode worker) under the same mixed workload.

    python -m loadtest.disagg_bench [--model smollm2] [--decode-streams 16]
        [--long-prompts 3] [--long-prompt-tokens 2048] [--interval 6] [--output-tokens 160]
        [--out bench-results]

Workload: `--decode-streams` streaming requests with short prompts decode `--output-tokens`
tokens each (EOS ignored) while `--long-prompts` prompts of `--long-prompt-tokens` tokens
arrive every `--interval` seconds. Measured per system, one after the other on this machine
(each server started fresh on 127.0.0.1, stopped afterwards): inter-token latency of the
decoding streams (p50/p99), TTFT of the long prompts (p50/p99), output tokens per second, and
for the disaggregated system the KV transfer throughput (bytes / transfer seconds, from the
server's metrics) beside a plain memory copy of the same number of bytes here, and how much
of the transfer overlapped the prefill's compute.

It talks HTTP only (no server imports): the servers are `splitserve serve` processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def stream_completion(client: httpx.AsyncClient, prompt, max_tokens: int) -> dict:
    """One streamed completion: TTFT and every inter-chunk gap, from a monotonic clock."""
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"ttft": times[0] - t0 if times else None,
            "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": usage["completion_tokens"] if usage else len(times), "end": times[-1]}


async def workload(url: str, args) -> dict:
    rnd = random.Random(0)
    short = [[rnd.randrange(100, 40000) for _ in range(32)] for _ in range(args.decode_streams)]
    long = [[rnd.randrange(100, 40000) for _ in range(args.long_prompt_tokens)]
            for _ in range(args.long_prompts)]
    limits = httpx.Limits(max_connections=args.decode_streams + args.long_prompts + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        decoders = [asyncio.create_task(stream_completion(client, p, args.output_tokens))
                    for p in short]

        async def late(i, p):
            await asyncio.sleep(args.interval * (i + 1) / 2)
            return await stream_completion(client, p, 8)

        longs = [asyncio.create_task(late(i, p)) for i, p in enumerate(long)]
        dec = await asyncio.gather(*decoders)
        lng = await asyncio.gather(*longs)
        wall = time.perf_counter() - t0
    itl = [g for d in dec for g in d["itl"]]
    ttft = [x["ttft"] for x in lng]
    tokens = sum(d["tokens"] for d in dec) + sum(x["tokens"] for x in lng)
    return {"itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "itl_max": max(itl),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tokens_per_s": tokens / wall, "wall_s": wall, "output_tokens": tokens}


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def memcpy_seconds(nbytes: int) -> float:
    import torch

    src = torch.ones(max(1, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


def transfer_microbench(tokens: int = 2048, dtype: str = "float32", reps: int = 3) -> dict:
    """The KV of one `tokens`-token SmolLM2 prompt through KVSender -> TCP loopback ->
    KVReceiver (checksums, validation, writes into a second pool), against a memcpy of the
    same bytes. No model compute: the wire path alone."""
    import threading

    import torch
    import zmq

    from cache.block_pool import BlockManager
    from cache.kv_storage import KVCacheStorage
    from cache.layout import KVLayout
    from cache.transfer import KVReceiver, KVSender
    from scheduler.protocol import kv_channel
    from scheduler.sampling_params import SamplingParams

    lay = KVLayout(30, 3, 64, dtype, 16)
    nb = lay.blocks_for_tokens(tokens) + 1
    src, dst = KVCacheStorage(lay, nb, "cpu"), KVCacheStorage(lay, nb, "cpu")
    src.tensor.normal_()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    ep = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    sender, chan = KVSender(ctx, src), kv_channel()
    table = list(range(lay.blocks_for_tokens(tokens)))
    best = float("inf")
    for rep in range(reps):
        blocks = BlockManager(nb, 16)
        recv = KVReceiver(blocks, dst)
        rid = f"r{rep}"
        recv.request(rid, [0] * tokens, SamplingParams())
        recv.admit_pending()
        t0 = time.perf_counter()
        th = threading.Thread(target=lambda rid=rid: [
            sender.send_layer(ep, rid, i, table, tokens) for i in range(lay.num_layers)])
        th.start()
        for _ in range(lay.num_layers):
            msg, frames = chan.decode(pull.recv_multipart(copy=False))
            assert recv.on_layer(msg, frames) is None
        best = min(best, time.perf_counter() - t0)
        th.join()
    nbytes = len(table) * lay.bytes_per_block
    assert torch.equal(dst.tensor[:, :, : len(table)], src.tensor[:, :, : len(table)])
    sender.close()
    pull.close()
    ctx.term()
    return {"bytes": nbytes, "transfer_gb_s": nbytes / best / 1e9,
            "memcpy_gb_s": nbytes / memcpy_seconds(nbytes) / 1e9}


def run_system(mode: str, args, out_dir: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "--log-level", "WARNING", "serve", "--port",
           str(port), "--model", args.model, "--mode", mode, *args.server_args]
    log = open(out_dir / f"disagg-bench-{mode}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{mode} server did not start; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        asyncio.run(workload(url, _warm(args)))  # warm-up: first-call costs off the record
        before = httpx.get(url + "/metrics").text
        res = asyncio.run(workload(url, args))
        after = httpx.get(url + "/metrics").text
        res["mode"] = mode
        nbytes = (metric_sum(after, "splitserve_kv_transfer_bytes_total")
                  - metric_sum(before, "splitserve_kv_transfer_bytes_total"))
        secs = (metric_sum(after, "splitserve_kv_transfer_seconds_sum")
                - metric_sum(before, "splitserve_kv_transfer_seconds_sum"))
        exposed = (metric_sum(after, "splitserve_kv_transfer_exposed_seconds_sum")
                   - metric_sum(before, "splitserve_kv_transfer_exposed_seconds_sum"))
        n = (metric_sum(after, "splitserve_kv_transfer_seconds_count")
             - metric_sum(before, "splitserve_kv_transfer_seconds_count"))
        if n:
            res.update(kv_transfers=int(n), kv_bytes_per_transfer=int(nbytes / n),
                       kv_transfer_s_mean=secs / n, kv_exposed_s_mean=exposed / n,
                       kv_overlap=1 - exposed / secs if secs else float("nan"))
        return res
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _warm(args):
    w = argparse.Namespace(**vars(args))
    w.decode_streams, w.long_prompts, w.output_tokens, w.interval = 2, 1, 4, 0.0
    return w


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--decode-streams", type=int, default=16)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-prompt-tokens", type=int, default=2048)
    ap.add_argument("--interval", type=float, default=6.0)
    ap.add_argument("--output-tokens", type=int, default=160)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                    help="passed to both servers (after this flag)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_system(m, args, out) for m in ("colocated", "disaggregated")]
    print(f"\n{args.decode_streams} streams decoding {args.output_tokens} tokens while "
          f"{args.long_prompts} prompts of {args.long_prompt_tokens} tokens arrive every "
          f"{args.interval:g}s; model {args.model}; {os.cpu_count()} cores\n")
    print("| system | ITL p50 ms | ITL p99 ms | ITL max ms | TTFT p50 s | TTFT p99 s "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {1e3 * r['itl_p50']:.1f} | {1e3 * r['itl_p99']:.1f} | "
              f"{1e3 * r['itl_max']:.0f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
              f"{r['tokens_per_s']:.1f} |")
    d = rows[1]
    if "kv_transfers" in d:
        print(f"\nIn the run: {d['kv_transfers']} KV transfers of "
              f"{d['kv_bytes_per_transfer']:,} bytes; first layer sent to commit "
              f"{d['kv_transfer_s_mean']:.3f} s on average, of which "
              f"{d['kv_exposed_s_mean']:.3f} s after the prefill forward ended: "
              f"{100 * d['kv_overlap']:.0f}% of the transfer overlapped compute.")
    mb = transfer_microbench(args.long_prompt_tokens)
    print(f"Wire path alone (KVSender -> TCP loopback -> KVReceiver with crc32 and writes), "
          f"the KV of one {args.long_prompt_tokens}-token prompt ({mb['bytes']:,} bytes): "
          f"{mb['transfer_gb_s']:.2f} GB/s vs memcpy of the same bytes "
          f"{mb['memcpy_gb_s']:.2f} GB/s ({mb['transfer_gb_s'] / mb['memcpy_gb_s']:.2f}x)")
    (out / "disagg.json").write_text(json.dumps({"systems": rows, "transfer": mb}, indent=2))
    print(f"\nwrote {out / 'disagg.json'}")


if __name__ == "__main__":
    main()
