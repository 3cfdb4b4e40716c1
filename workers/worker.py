"""The worker process: an engine behind a ZMQ DEALER socket, in one of three roles.

    splitserve worker --role colocated|prefill|decode --scheduler tcp://HOST:PORT [flags]

colocated: prefill and decode requests itself (AddRequest).
prefill:   prefills PrefillRequests, samples the first token (sent to the gateway: that is
           TTFT) and pushes the prompt's KV, layer by layer as the forward computes it,
           straight to the decode worker named in the request; then commits the first token.
decode:    binds a KV endpoint (advertised in its hello), holds blocks for ReserveRequests,
           writes arriving KV into them, and decodes committed requests in its continuous
           batch; short prompts may also be sent to it whole (AddRequest), with no transfer.

The loop: take every waiting message (gateway socket, and KV socket on a decode worker),
expire reservations, run one engine step if there is work, send that step's tokens with its
stats, and send a heartbeat at least once a second. Routing decisions are the gateway's.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq

from cache.transfer import KVReceiver, KVSender
from scheduler.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    KVCommit,
    KVLayer,
    KVTransferDone,
    ModelFingerprint,
    PrefillRequest,
    RequestFailed,
    ReservationExpired,
    Reserved,
    ReserveRequest,
    Shutdown,
    StepOutputs,
    WorkerCapacity,
    WorkerStats,
    encode,
    kv_channel,
    worker_channel,
)
from scheduler.sampling_params import SamplingParamsError
from workers.device import dtype_name
from workers.engine import EngineConfig, LLMEngine

log = logging.getLogger("splitserve.worker")

HEARTBEAT_S = 1.0
IDLE_POLL_MS = 50
HELLO_TIMEOUT_S = 30.0
ROLES = ("colocated", "prefill", "decode")


def fingerprint(engine: LLMEngine) -> ModelFingerprint:
    cfg, layout = engine.model_config, engine.kv_layout
    return ModelFingerprint(
        model=cfg.name, dtype=dtype_name(engine.dtype), kv_dtype=layout.dtype,
        block_size=layout.block_size, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, vocab_size=cfg.vocab_size,
    )


class Worker:
    def __init__(self, engine: LLMEngine, scheduler_addr: str, worker_id: str | None = None,
                 role: str = "colocated", parent_pid: int | None = None,
                 kv_host: str = "127.0.0.1", kv_port: int = 0,
                 reservation_timeout_s: float = 30.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
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
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.kv_endpoint = ""
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        self.kv_sock: zmq.Socket | None = None
        self.targets: dict[str, str] = {}  # prefill role: request id -> decode KV endpoint
        if role == "decode":
            self.kv_sock = self.ctx.socket(zmq.PULL)
            self.kv_sock.setsockopt(zmq.LINGER, 0)
            self.kv_sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.kv_sock.setsockopt(zmq.RCVHWM, 4096)
            self.kv_sock.bind(f"tcp://{kv_host}:{kv_port or '*'}")
            port = self.kv_sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
            self.kv_endpoint = f"tcp://{kv_host}:{port}"
            self.kv_channel = kv_channel()
            self.poller.register(self.kv_sock, zmq.POLLIN)
            self.receiver = KVReceiver(engine.blocks, engine.kv, reservation_timeout_s)
        elif role == "prefill":
            self.sender = KVSender(self.ctx, engine.kv)
            engine.on_kv_layer = self._export_layer
        self._running = True
        self._last_sent = 0.0

    # -- messages out --
    def stats(self) -> WorkerStats:
        e = self.engine
        s = WorkerStats(
            num_running=e.num_running, num_waiting=e.num_waiting,
            num_blocks_used=e.blocks.num_used_blocks, num_blocks_total=e.blocks.num_total_blocks,
            num_preemptions=e.policy.num_preemptions, num_steps=e.num_steps,
            prefill_queue_tokens=e.num_uncomputed_prompt_tokens(),
        )
        if self.receiver is not None:
            s.num_reserved_blocks = self.receiver.num_reserved_blocks
            s.kv_bytes_received = self.receiver.bytes_received
            s.kv_transfer_failures = self.receiver.failures
        if self.sender is not None:
            s.kv_transfer_failures = self.sender.failures
        return s

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
            pid=os.getpid(), kv_endpoint=self.kv_endpoint,
        ))
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.sock.poll(200):
                got = self.channel.decode(self.sock.recv_multipart())
                if got and isinstance(got[0], HelloAck):
                    if not got[0].accepted:
                        raise RuntimeError(f"the gateway refused this worker: {got[0].reason}")
                    log.info("registered with the gateway as %s (%s%s)", self.worker_id,
                             self.role, f", KV at {self.kv_endpoint}" if self.kv_endpoint else "")
                    return
            self._check_parent()
            if not self._running:
                raise RuntimeError("the launching process is gone")
        raise TimeoutError(f"no answer to hello within {HELLO_TIMEOUT_S:.0f}s")

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("the launching process is gone; exiting")
            self._running = False

    # -- prefill role --
    def _export_layer(self, exports, layer: int) -> None:
        for rid, table, num_tokens in exports:
            endpoint = self.targets.get(rid)
            if endpoint:
                self.sender.send_layer(endpoint, rid, layer, table, num_tokens)

    # -- messages in --
    def _add(self, rid: str, prompt, params, **kw) -> bool:
        try:
            self.engine.add_request(rid, prompt, params, **kw)
            return True
        except (ValueError, SamplingParamsError) as e:
            self._send(RequestFailed(rid, str(e), status=400))
            return False

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg.request_id, msg.prompt_token_ids, msg.params)
        elif isinstance(msg, ReserveRequest) and self.receiver is not None:
            self.receiver.request(msg.request_id, msg.prompt_token_ids, msg.params)
        elif isinstance(msg, PrefillRequest) and self.sender is not None:
            if self._add(msg.request_id, msg.prompt_token_ids, msg.params, prefill_only=True):
                self.targets[msg.request_id] = msg.kv_endpoint
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort(rid)
                self.targets.pop(rid, None)
                if self.receiver is not None:
                    self.receiver.cancel(rid)
        elif isinstance(msg, Shutdown):
            log.info("shutdown asked: %s", msg.reason or "no reason given")
            self._running = False
        else:
            log.warning("ignored %s: not for a %s worker", type(msg).__name__, self.role)

    def _handle_kv(self, msg, frames) -> None:
        r = self.receiver
        if isinstance(msg, KVLayer):
            why = r.on_layer(msg, frames)
            if why is not None and msg.request_id in r.active:
                r.cancel(msg.request_id)  # a bad layer cannot be completed: retry elsewhere
                self._send(ReservationExpired(msg.request_id, f"bad KV transfer: {why}"))
        elif isinstance(msg, KVCommit):
            was_active = msg.request_id in r.active
            res, why = r.on_commit(msg)
            if res is None:
                if was_active:
                    self._send(ReservationExpired(msg.request_id, f"bad KV transfer: {why}"))
                return
            try:
                self.engine.add_prefilled(res.request_id, res.prompt_token_ids,
                                          msg.first_token, res.params)
            except ValueError as e:
                self.engine.blocks.free(res.request_id)
                self._send(ReservationExpired(res.request_id, f"cannot join the batch: {e}"))
                return
            now = time.time()
            secs = max(0.0, now - res.first_sent_at) if res.first_sent_at else 0.0
            exposed = min(secs, max(0.0, now - msg.compute_done_at)) if msg.compute_done_at else 0
            self._send(KVTransferDone(res.request_id, res.num_bytes, secs, exposed))

    def _poll(self, timeout_ms: int) -> None:
        while True:
            events = dict(self.poller.poll(timeout_ms))
            if not events:
                return
            if self.sock in events:
                got = self.channel.decode(self.sock.recv_multipart())
                if got is not None:
                    self._handle(got[0])
            if self.kv_sock is not None and self.kv_sock in events:
                got = self.kv_channel.decode(self.kv_sock.recv_multipart(copy=False))
                if got is not None:
                    self._handle_kv(*got)
            timeout_ms = 0

    def _reservations(self) -> None:
        r = self.receiver
        changed = False
        for res in r.expire():
            self._send(ReservationExpired(res.request_id, "KV did not arrive within "
                                          f"{r.timeout_s:.0f}s"))
            changed = True
        for res in r.admit_pending():
            self._send(Reserved(res.request_id, res.num_blocks, r.timeout_s))
            changed = True
        if changed:  # routing reads free blocks from stats: keep them current
            self._send(Heartbeat(self.worker_id, self.stats()))

    def _step(self) -> None:
        deltas = self.engine.step()
        computed_at = time.time()
        if not deltas:
            return
        commits = []
        for d in deltas:
            if d.finish_reason == "transferred":  # the request goes on at the decode worker
                endpoint = self.targets.pop(d.request_id, None)
                if endpoint:
                    lp = d.logprobs[0] if d.logprobs else None
                    commits.append((endpoint, d.request_id, d.token_ids[0], lp))
                d.finished, d.finish_reason = False, None
            elif d.finished:
                self.targets.pop(d.request_id, None)
        # first tokens to the gateway before the commits: the decode worker's later tokens
        # can then never reach the gateway ahead of them from a worker that died in between
        self._send(StepOutputs(self.worker_id, deltas, self.stats()))
        for endpoint, rid, token, lp in commits:
            self.sender.commit(endpoint, rid, token, lp, computed_at)

    def run(self) -> None:
        self.hello()
        try:
            while self._running:
                self._poll(0 if self.engine.has_unfinished() else IDLE_POLL_MS)
                if not self._running:
                    break
                if self.receiver is not None:
                    self._reservations()
                if self.engine.has_unfinished():
                    self._step()
                if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._send(Heartbeat(self.worker_id, self.stats()))
                    self._check_parent()
        finally:
            try:
                self._send(Goodbye(self.worker_id, "shutting down"))
            except zmq.ZMQError:
                pass
            if self.sender is not None:
                self.sender.close()
            if self.kv_sock is not None:
                self.kv_sock.close()
            self.sock.close()
            self.ctx.term()


def run_worker(config: EngineConfig, scheduler_addr: str, role: str, worker_id: str | None,
               parent_pid: int | None, kv_host: str = "127.0.0.1", kv_port: int = 0,
               reservation_timeout_s: float = 30.0) -> None:
    engine = LLMEngine(config)
    Worker(engine, scheduler_addr, worker_id, role, parent_pid, kv_host, kv_port,
           reservation_timeout_s).run()
