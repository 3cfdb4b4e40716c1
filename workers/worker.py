"""The worker process: an engine behind a ZMQ DEALER socket.

    splitserve worker --role colocated --scheduler tcp://HOST:PORT [engine flags]

It says hello (protocol version, model fingerprint, capacity), then loops: take every message
waiting on the socket (add / abort / shutdown), run one engine step if there is work, send
that step's token deltas with its stats, and send a heartbeat at least once a second.
Decisions about *which* worker gets a request are the gateway's; this loop only executes.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq

from scheduler.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    ModelFingerprint,
    RequestFailed,
    Shutdown,
    StepOutputs,
    WorkerCapacity,
    WorkerStats,
    encode,
    worker_channel,
)
from scheduler.sampling_params import SamplingParamsError
from workers.device import dtype_name
from workers.engine import EngineConfig, LLMEngine

log = logging.getLogger("splitserve.worker")

HEARTBEAT_S = 1.0
IDLE_POLL_MS = 50
HELLO_TIMEOUT_S = 30.0
ROLES = ("colocated",)


def fingerprint(engine: LLMEngine) -> ModelFingerprint:
    cfg, layout = engine.model_config, engine.kv_layout
    return ModelFingerprint(
        model=cfg.name, dtype=dtype_name(engine.dtype), kv_dtype=layout.dtype,
        block_size=layout.block_size, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, vocab_size=cfg.vocab_size,
    )


class Worker:
    def __init__(self, engine: LLMEngine, scheduler_addr: str, worker_id: str | None = None,
                 role: str = "colocated", parent_pid: int | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not available yet (one of {ROLES})")
        self.engine = engine
        self.role = role
        self.worker_id = worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.connect(scheduler_addr)
        self.channel = worker_channel()
        self._running = True
        self._last_sent = 0.0

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(
            num_running=e.num_running, num_waiting=e.num_waiting,
            num_blocks_used=e.blocks.num_used_blocks, num_blocks_total=e.blocks.num_total_blocks,
            num_preemptions=e.policy.num_preemptions, num_steps=e.num_steps,
        )

    def _send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))
        self._last_sent = time.monotonic()

    def hello(self) -> None:
        e = self.engine
        self._send(Hello(
            worker_id=self.worker_id, role=self.role, protocol_version=PROTOCOL_VERSION,
            fingerprint=fingerprint(e),
            capacity=WorkerCapacity(
                num_blocks=e.blocks.num_total_blocks, block_size=e.kv_layout.block_size,
                bytes_per_token=e.kv_layout.bytes_per_token, max_model_len=e.max_model_len,
                max_num_seqs=e.config.max_num_seqs),
            pid=os.getpid(),
        ))
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.sock.poll(200):
                got = self.channel.decode(self.sock.recv_multipart())
                if got and isinstance(got[0], HelloAck):
                    if not got[0].accepted:
                        raise RuntimeError(f"the gateway refused this worker: {got[0].reason}")
                    log.info("registered with the gateway as %s", self.worker_id)
                    return
            self._check_parent()
        raise TimeoutError(f"no answer to hello within {HELLO_TIMEOUT_S:.0f}s")

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("the launching process is gone; exiting")
            self._running = False

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
            except (ValueError, SamplingParamsError) as e:
                self._send(RequestFailed(msg.request_id, str(e), status=400))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort(rid)
        elif isinstance(msg, Shutdown):
            log.info("shutdown asked: %s", msg.reason or "no reason given")
            self._running = False

    def run(self) -> None:
        self.hello()
        try:
            while self._running:
                timeout = 0 if self.engine.has_unfinished() else IDLE_POLL_MS
                while self.sock.poll(timeout):
                    got = self.channel.decode(self.sock.recv_multipart())
                    if got is not None:
                        self._handle(got[0])
                    timeout = 0
                if not self._running:
                    break
                if self.engine.has_unfinished():
                    deltas = self.engine.step()
                    if deltas:
                        self._send(StepOutputs(self.worker_id, deltas, self.stats()))
                if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._send(Heartbeat(self.worker_id, self.stats()))
                    self._check_parent()
        finally:
            try:
                self._send(Goodbye(self.worker_id, "shutting down"))
            except zmq.ZMQError:
                pass
            self.sock.close()
            self.ctx.term()


def run_worker(config: EngineConfig, scheduler_addr: str, role: str, worker_id: str | None,
               parent_pid: int | None) -> None:
    engine = LLMEngine(config)
    Worker(engine, scheduler_addr, worker_id, role, parent_pid).run()
