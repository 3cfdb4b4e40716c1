"""`splitserve serve`: the gateway process, and the worker processes it launches.

The gateway binds the scheduler socket, starts `--num-workers` colocated workers as child
processes (`splitserve worker ...`, the same command a remote worker runs), waits for their
hello, prints the URL, and serves HTTP. Ctrl-C / SIGTERM: workers are told to shut down,
then terminated if they linger; a worker whose parent dies exits by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import time

from scheduler.global_scheduler import GlobalScheduler, GlobalSchedulerConfig
from server.metrics import Metrics

log = logging.getLogger("splitserve.launcher")

ENGINE_FLAGS = ("model", "dtype", "device", "block_size", "kv_cache_memory", "num_kv_blocks",
                "max_num_batched_tokens", "max_num_seqs", "max_model_len", "seed", "num_threads")


def engine_argv(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for name in ENGINE_FLAGS:
        v = getattr(args, name)
        if v is not None:
            out += ["--" + name.replace("_", "-"), str(v)]
    return out


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: derived from --model)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"],
                   help="disaggregated: prefill and decode worker pools; colocated: workers "
                        "that do both")
    g.add_argument("--prefill-workers", type=int, default=1,
                   help="prefill workers to launch (disaggregated mode)")
    g.add_argument("--decode-workers", type=int, default=1,
                   help="decode workers to launch (disaggregated mode)")
    g.add_argument("--num-workers", type=int, default=1,
                   help="colocated workers to launch (colocated mode)")
    g.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="prompts shorter than this prefill on the decode worker (0: off)")
    g.add_argument("--kv-reservation-timeout", type=float, default=30.0,
                   help="seconds a decode worker holds room for KV that has not arrived")
    g.add_argument("--scheduler-host", default="127.0.0.1",
                   help="address workers connect to (bind 0.0.0.0 for remote workers)")
    g.add_argument("--scheduler-port", type=int, default=0, help="0: pick a free port")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests admitted beyond what the workers run at once; then 429")
    g.add_argument("--worker-timeout", type=float, default=15.0,
                   help="seconds without a message before a worker is declared dead")
    g.add_argument("--worker-start-timeout", type=float, default=600.0,
                   help="seconds to wait for launched workers to load the model")


def served_name(args: argparse.Namespace, path) -> str:
    from workers.loaders.resolve import DEFAULT_MODEL, model_display_name

    if args.served_model_name:
        return args.served_model_name
    return DEFAULT_MODEL if args.model in (None, "", DEFAULT_MODEL) else model_display_name(path)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import GatewayState, create_app
    from server.engine_client import EngineClient
    from server.tokenizer import load_tokenizer
    from workers.loaders.resolve import resolve_model_path

    for flag in ("num_workers", "prefill_workers", "decode_workers",
                 "local_prefill_max_tokens"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
    if args.mode == "colocated":
        roles = ["colocated"] * args.num_workers
    else:
        roles = ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers
    if args.num_threads is None and roles:
        # share this machine's cores among the workers launched on it
        args.num_threads = max(1, (os.cpu_count() or 1) // len(roles))
    path = resolve_model_path(args.model)
    name = served_name(args, path)
    print(f"splitserve: loading the tokenizer of {path.name} ...", file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(path)
    scheduler = GlobalScheduler(GlobalSchedulerConfig(
        max_queued_requests=args.max_queued_requests, worker_timeout_s=args.worker_timeout,
        local_prefill_max_tokens=args.local_prefill_max_tokens))
    metrics = Metrics(name)
    client = EngineClient(scheduler, metrics,
                          f"tcp://{args.scheduler_host}:{args.scheduler_port or '*'}")
    procs: list[subprocess.Popen] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        addr = await client.start()
        print(f"splitserve: scheduler listening on {addr}", file=sys.stderr, flush=True)
        counts: dict[str, int] = {}
        for role in roles:
            i = counts[role] = counts.get(role, -1) + 1
            cmd = [sys.executable, "-m", "server.cli", "--log-level", args.log_level, "worker",
                   "--role", role, "--scheduler", addr, "--worker-id", f"{role}-{i}",
                   "--parent-pid", str(os.getpid()),
                   "--reservation-timeout", str(args.kv_reservation_timeout),
                   *engine_argv(args)]
            procs.append(subprocess.Popen(cmd))
        if roles:
            print(f"splitserve: waiting for {len(roles)} worker(s) ({', '.join(roles)}) to load "
                  "the model ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            while not await client.wait_for_workers(len(roles), 2.0):
                dead = [p for p in procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"a worker exited with code {dead[0].returncode} "
                                       "before it was ready")
                if time.monotonic() - t0 > args.worker_start_timeout:
                    raise RuntimeError("workers did not become ready in time")
        state.max_model_len = args.max_model_len
        print(f"splitserve: ready, serving '{name}' at http://{args.host}:{args.port}/v1",
              file=sys.stderr, flush=True)
        try:
            yield
        finally:
            await client.close()
            _stop(procs)

    state = GatewayState(model_name=name, tokenizer=tokenizer, client=client,
                         scheduler=scheduler, metrics=metrics, api_key=args.api_key,
                         created=int(time.time()))
    app = create_app(state, lifespan=lifespan)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=5)
    finally:
        _stop(procs)
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 10
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode"])
    p.add_argument("--kv-host", default="127.0.0.1",
                   help="decode role: address to bind and advertise for incoming KV")
    p.add_argument("--kv-port", type=int, default=0, help="decode role: KV port (0: free port)")
    p.add_argument("--reservation-timeout", type=float, default=30.0,
                   help="decode role: seconds to hold room for KV that has not arrived")
    p.add_argument("--scheduler", required=True, help="the gateway's scheduler address, "
                   "e.g. tcp://127.0.0.1:5555")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def cmd_worker(args: argparse.Namespace) -> int:
    from server.cli import engine_config_from_args
    from workers.worker import run_worker

    config = engine_config_from_args(args)
    run_worker(config, args.scheduler, args.role, args.worker_id, args.parent_pid,
               args.kv_host, args.kv_port, args.reservation_timeout)
    return 0


