"""The gateway's side of the wire: a ZMQ ROUTER that workers connect to.

It carries out the global scheduler's decisions (admit, route, abort), turns worker messages
into per-request asyncio queues, and records request latencies as tokens arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from scheduler.global_scheduler import GlobalScheduler, NoWorkerAvailable
from scheduler.protocol import (
    MAX_MESSAGE_BYTES,
    AbortRequests,
    AddRequest,
    Goodbye,
    Hello,
    HelloAck,
    KVTransferDone,
    PrefillRequest,
    RequestFailed,
    ReservationExpired,
    Reserved,
    ReserveRequest,
    Shutdown,
    StepOutputs,
    TokenDelta,
    encode,
    gateway_channel,
)
from scheduler.sampling_params import SamplingParams
from server.metrics import Metrics

log = logging.getLogger("splitserve.gateway")


class RequestError(Exception):
    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_


MAX_PREFILL_ATTEMPTS = 2  # a failed KV transfer is retried once, on another prefill worker


@dataclass
class RequestStream:
    """One request's life at the gateway. Phases (disaggregated): reserving (a decode worker
    is asked for room) -> prefilling (a prefill worker computes and pushes the KV) ->
    decoding; colocated and local-prefill requests go straight to decoding."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    phase: str = "decoding"
    decode_worker: str | None = None
    prefill_worker: str | None = None
    failed_prefill: set[str] = field(default_factory=set)
    attempts: int = 0
    early: dict[int, TokenDelta] = field(default_factory=dict)  # deltas that overtook others
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    prefill_s: float | None = None
    done: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


class EngineClient:
    def __init__(self, scheduler: GlobalScheduler, metrics: Metrics, bind: str) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.bind = bind
        self.address: str | None = None
        self.streams: dict[str, RequestStream] = {}
        self.channel = gateway_channel()
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._pending_sends: set[asyncio.Task] = set()
        self._worker_event = asyncio.Event()

    # -- lifecycle --
    async def start(self) -> str:
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 500)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, 100000)
        s.bind(self.bind)
        self._sock = s
        self.address = s.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks = [asyncio.create_task(self._recv_loop()),
                       asyncio.create_task(self._monitor_loop())]
        return self.address

    async def wait_for_workers(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.scheduler.live_workers()) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._worker_event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._worker_event.wait(), min(left, 1.0))
        return True

    async def close(self) -> None:
        for w in list(self.scheduler.live_workers()):
            await self._send(w.worker_id, Shutdown("gateway shutting down"))
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()

    # -- requests --
    def submit(self, request_id: str, prompt: list[int], params: SamplingParams
               ) -> RequestStream:
        """Route a request (admission is checked by the caller via scheduler.admit)."""
        route = self.scheduler.route(request_id, len(prompt))
        stream = RequestStream(request_id, list(prompt), params, decode_worker=route.worker)
        self.streams[request_id] = stream
        self.metrics.gateway_waiting.labels(self.metrics.model_name).inc()
        if route.kind == "disaggregated":
            stream.phase = "reserving"
            msg = ReserveRequest(request_id, stream.prompt, params)
        else:
            msg = AddRequest(request_id, stream.prompt, params)
        self._spawn(self._send(route.worker, msg))
        return stream

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request: the client went away, or the gateway finished it (stop string)."""
        stream = self.streams.get(request_id)
        workers = self.scheduler.workers_of(request_id)
        if stream is not None and not stream.done:
            self._finish(stream, reason, observe=reason != "abort")
        for wid in workers:
            await self._send(wid, AbortRequests([request_id]))

    async def _send(self, worker_id: str, msg) -> None:
        try:
            await self._sock.send_multipart([worker_id.encode(), *encode(msg)])
        except zmq.ZMQError as e:  # worker gone (ROUTER_MANDATORY): its requests fail below
            log.warning("send to %s failed: %s", worker_id, e)

    def _release_workers(self, request_id: str) -> None:
        """Tell every worker still holding state for the request to drop it."""
        for wid in self.scheduler.workers_of(request_id):
            self._spawn(self._send(wid, AbortRequests([request_id])))

    def _close(self, request_id: str) -> RequestStream | None:
        """Forget a request at the gateway; returns its stream if it was still open."""
        stream = self.streams.pop(request_id, None)
        self.scheduler.finish(request_id)
        if stream is None or stream.done:
            return None
        stream.done = True
        self.metrics.gateway_waiting.labels(self.metrics.model_name).dec()
        return stream

    def _finish(self, stream: RequestStream, reason: str, observe: bool = True) -> None:
        self._close(stream.request_id)
        if not observe:
            self.metrics.success.labels(self.metrics.model_name, reason).inc()
            return
        now = time.monotonic()
        ttft = None if stream.first_token_at is None else stream.first_token_at - stream.arrival
        prefill = stream.prefill_s or 0.0
        self.metrics.observe_finished(
            queue_s=(ttft - prefill) if ttft is not None else 0.0, ttft_s=ttft,
            e2e_s=(stream.last_token_at or now) - stream.arrival, prefill_s=prefill,
            prompt_tokens=stream.num_prompt_tokens, output_tokens=stream.num_output_tokens,
            finish_reason=reason)

    def _fail(self, request_id: str, status: int, message: str, type_: str) -> None:
        self._release_workers(request_id)
        stream = self._close(request_id)
        if stream is None:
            return
        self.metrics.errors.labels(self.metrics.model_name, type_).inc()
        stream.queue.put_nowait(RequestError(status, message, type_))

    # -- incoming --
    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            identity = bytes(frames[0].buffer).decode(errors="replace")
            got = self.channel.decode([f.buffer for f in frames[1:]])
            if got is None:
                self.metrics.dropped_messages.labels(self.metrics.model_name).inc()
                continue
            try:
                await self._on_message(identity, got[0])
            except Exception:  # one bad message must not stop the gateway
                log.exception("error handling %s from %s", type(got[0]).__name__, identity)

    async def _on_message(self, identity: str, msg) -> None:
        if isinstance(msg, Hello):
            if msg.worker_id != identity:
                await self._send(identity, HelloAck(False, "worker_id must equal the socket "
                                                    "identity"))
                return
            ok, reason = self.scheduler.register(msg)
            await self._send(identity, HelloAck(ok, reason))
            if ok:
                c = msg.capacity
                log.info("worker %s (%s, pid %d) joined: %s %s, %d KV blocks x %d tokens, "
                         "%d bytes/token", msg.worker_id, msg.role, msg.pid, msg.fingerprint.model,
                         msg.fingerprint.dtype, c.num_blocks, c.block_size, c.bytes_per_token)
                self.metrics.add_worker(msg.worker_id, msg.role, c.num_blocks, c.bytes_per_token)
                self.metrics.workers.labels(self.metrics.model_name, msg.role).inc()
                self._worker_event.set()
            else:
                log.error("refused worker %s: %s", msg.worker_id, reason)
            return
        stats = getattr(msg, "stats", None)
        if not self.scheduler.seen(identity, stats):
            return  # not registered (or refused): ignore
        w = self.scheduler.workers[identity]
        if stats is not None:
            self.metrics.update_worker(identity, w.role, stats)
            self.metrics.update_transfer_failures(identity, stats.kv_transfer_failures)
        if isinstance(msg, StepOutputs):
            now = time.monotonic()
            for d in msg.deltas:
                self._on_delta(d, now, w.role)
        elif isinstance(msg, Reserved):
            self.scheduler.reservation_confirmed(msg.request_id)
            await self._start_prefill(msg.request_id)
        elif isinstance(msg, ReservationExpired):
            await self._prefill_failed(msg.request_id, msg.reason)
        elif isinstance(msg, KVTransferDone):
            m = self.metrics
            m.kv_transfer_seconds.labels(m.model_name).observe(msg.seconds)
            m.kv_transfer_exposed_seconds.labels(m.model_name).observe(msg.exposed_seconds)
            m.kv_transfer_bytes.labels(m.model_name).inc(msg.num_bytes)
            self.scheduler.prefill_done(msg.request_id)
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                stream.phase = "decoding"
        elif isinstance(msg, RequestFailed):
            self._fail(msg.request_id, msg.status, msg.message,
                       "invalid_request_error" if msg.status < 500 else "internal_error")
        elif isinstance(msg, Goodbye):
            self._drop_worker(identity, f"worker {identity} left: {msg.reason}")

    async def _start_prefill(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is None or stream.done or stream.phase != "reserving":
            return  # finished or aborted meanwhile (the abort also released the reservation)
        try:
            pw = self.scheduler.route_prefill(request_id, stream.num_prompt_tokens,
                                              frozenset(stream.failed_prefill))
        except NoWorkerAvailable as e:
            self._fail(request_id, 503, str(e), "service_unavailable")
            return
        dw = self.scheduler.workers.get(stream.decode_worker)
        if dw is None:
            self._fail(request_id, 503, "the decode worker went away", "service_unavailable")
            return
        stream.phase, stream.prefill_worker = "prefilling", pw
        stream.attempts += 1
        await self._send(pw, PrefillRequest(request_id, stream.prompt, stream.params,
                                            dw.worker_id, dw.kv_endpoint))

    async def _prefill_failed(self, request_id: str, why: str) -> None:
        """The KV never arrived (prefill worker died, transfer lost or corrupt): retry the
        prefill once on another prefill worker with a fresh reservation, or fail clearly."""
        stream = self.streams.get(request_id)
        m = self.metrics
        if stream is None or stream.done or stream.phase not in ("reserving", "prefilling"):
            return
        if stream.prefill_worker:
            stream.failed_prefill.add(stream.prefill_worker)
            await self._send(stream.prefill_worker, AbortRequests([request_id]))
        self.scheduler.prefill_done(request_id)
        if not self.scheduler.live_workers("prefill"):
            self._fail(request_id, 503, f"prefill failed ({why}) and no prefill worker is "
                       "left to retry on", "service_unavailable")
            return
        if stream.attempts >= MAX_PREFILL_ATTEMPTS or stream.first_token_at is not None:
            self._fail(request_id, 503, f"prefill failed after {stream.attempts} attempt(s): "
                       f"{why}", "service_unavailable")
            return
        log.warning("request %s: %s; retrying the prefill on another worker", request_id, why)
        m.kv_transfer_retries.labels(m.model_name).inc()
        stream.phase, stream.prefill_worker = "reserving", None
        if stream.decode_worker not in self.scheduler.workers:
            self._fail(request_id, 503, "the decode worker went away", "service_unavailable")
            return
        await self._send(stream.decode_worker, AbortRequests([request_id]))
        self.scheduler.expect_reservation(request_id, stream.decode_worker,
                                          stream.num_prompt_tokens)
        await self._send(stream.decode_worker,
                         ReserveRequest(request_id, stream.prompt, stream.params))

    def _on_delta(self, d: TokenDelta, now: float, role: str) -> None:
        stream = self.streams.get(d.request_id)
        if stream is None or stream.done:
            return  # aborted meanwhile
        start = d.num_output_tokens - len(d.token_ids)
        if start > stream.num_output_tokens:  # a decode token overtook the prefill's first
            stream.early[start] = d
            return
        self._accept_delta(stream, d, now, from_prefill=role == "prefill")
        while not stream.done and stream.num_output_tokens in stream.early:
            self._accept_delta(stream, stream.early.pop(stream.num_output_tokens), now)

    def _accept_delta(self, stream: RequestStream, d: TokenDelta, now: float,
                      from_prefill: bool = False) -> None:
        m = self.metrics
        n = len(d.token_ids)
        if stream.first_token_at is None:
            stream.first_token_at = now
            stream.prefill_s = d.prefill_s
            m.prompt_tokens.labels(m.model_name).inc(stream.num_prompt_tokens)
        elif stream.last_token_at is not None:
            m.itl.labels(m.model_name).observe(now - stream.last_token_at)
        stream.last_token_at = now
        stream.num_output_tokens += n
        m.generation_tokens.labels(m.model_name).inc(n)
        stream.queue.put_nowait(d)
        if d.finished:
            if from_prefill:  # finished at its first token: release the decode reservation
                self._release_workers(stream.request_id)
            self._finish(stream, d.finish_reason or "stop")

    def _drop_worker(self, worker_id: str, why: str) -> None:
        w = self.scheduler.workers.get(worker_id)
        if w is None:
            return
        lost = self.scheduler.remove_worker(worker_id)
        self.metrics.remove_worker(worker_id, w.role)
        self.metrics.workers.labels(self.metrics.model_name, w.role).dec()
        for rid in lost:
            stream = self.streams.get(rid)
            if (w.role == "prefill" and stream is not None and stream.phase == "prefilling"
                    and stream.prefill_worker == worker_id):
                self._spawn(self._prefill_failed(rid, why))
            else:
                self._fail(rid, 503, f"the worker serving this request went away ({why})",
                           "service_unavailable")
        log.error("%s; %d request(s) affected", why, len(lost))

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for wid in self.scheduler.dead_workers():
                self._drop_worker(wid, f"worker {wid} stopped responding")
