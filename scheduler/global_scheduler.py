"""The gateway's decisions: which workers are admitted, which one serves a request, and
whether a request is admitted at all. Pure Python; the asyncio/ZMQ plumbing that carries
these decisions out lives in `server/engine_client.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.protocol import PROTOCOL_VERSION, Hello, ModelFingerprint, WorkerStats

ROLES = ("colocated", "prefill", "decode")


class NoWorkerAvailable(RuntimeError):
    pass


class QueueFull(RuntimeError):
    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    fingerprint: ModelFingerprint
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int
    max_num_seqs: int
    pid: int
    last_seen: float
    kv_endpoint: str = ""
    stats: WorkerStats = field(default_factory=WorkerStats)
    requests: set[str] = field(default_factory=set)
    alive: bool = True
    pending_blocks: int = 0  # decode: reservations asked for, not yet in its stats
    queued_prefill_tokens: int = 0  # prefill: prompt tokens routed here and not yet done

    @property
    def free_blocks(self) -> int:
        return self.stats.num_blocks_total - self.stats.num_blocks_used - self.pending_blocks


@dataclass(frozen=True)
class Route:
    """Where a new request goes: `colocated` (one worker does everything), `local` (a decode
    worker prefills it itself: short prompt, no transfer) or `disaggregated` (reserve on
    `worker`, then prefill on a prefill worker chosen when the reservation is confirmed)."""

    kind: str
    worker: str


@dataclass(frozen=True)
class GlobalSchedulerConfig:
    max_queued_requests: int = 1024  # beyond what the workers can run at once
    worker_timeout_s: float = 15.0  # no message for this long: the worker is dead
    local_prefill_max_tokens: int = 0  # shorter prompts prefill on the decode worker; 0 = off


class GlobalScheduler:
    def __init__(self, config: GlobalSchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerInfo] = {}
        self.reference: ModelFingerprint | None = None  # the first admitted worker's
        self.refused: dict[str, str] = {}  # worker id -> why
        self.request_workers: dict[str, set[str]] = {}  # request -> workers holding state
        self.prefill_tokens: dict[str, tuple[str, int]] = {}  # request -> (prefill worker, n)
        self.reserving: dict[str, tuple[str, int]] = {}  # request -> (decode worker, blocks)

    # -- membership --
    def register(self, hello: Hello, now: float | None = None) -> tuple[bool, str]:
        if hello.role not in ROLES:
            reason = f"unknown role {hello.role!r}"
        elif hello.role == "decode" and not hello.kv_endpoint:
            reason = "a decode worker must advertise its KV endpoint"
        elif hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"protocol version {hello.protocol_version} != gateway's "
                      f"{PROTOCOL_VERSION}")
        elif self.reference is not None and hello.fingerprint != self.reference:
            diff = [f"{k}: {getattr(hello.fingerprint, k)!r} != {getattr(self.reference, k)!r}"
                    for k in hello.fingerprint.__struct_fields__
                    if getattr(hello.fingerprint, k) != getattr(self.reference, k)]
            reason = "model fingerprint mismatch (" + "; ".join(diff) + ")"
        else:
            reason = ""
        if reason:
            self.refused[hello.worker_id] = reason
            return False, reason
        self.reference = self.reference or hello.fingerprint
        c = hello.capacity
        self.workers[hello.worker_id] = WorkerInfo(
            worker_id=hello.worker_id, role=hello.role, fingerprint=hello.fingerprint,
            num_blocks=c.num_blocks, block_size=c.block_size, bytes_per_token=c.bytes_per_token,
            max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs, pid=hello.pid,
            last_seen=time.monotonic() if now is None else now, kv_endpoint=hello.kv_endpoint,
        )
        self.refused.pop(hello.worker_id, None)
        return True, ""

    def seen(self, worker_id: str, stats: WorkerStats | None, now: float | None = None) -> bool:
        w = self.workers.get(worker_id)
        if w is None or not w.alive:
            return False
        w.last_seen = time.monotonic() if now is None else now
        if stats is not None:
            w.stats = stats
        return True

    def expect_reservation(self, request_id: str, worker_id: str, prompt_len: int) -> None:
        """A ReserveRequest is on its way to `worker_id`: count its blocks as taken there
        until the worker confirms (its stats then show them) or the request ends."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        self.reservation_confirmed(request_id)  # a retry replaces the earlier estimate
        n = -(-(prompt_len + 1) // w.block_size)
        w.pending_blocks += n
        self.reserving[request_id] = (worker_id, n)

    def reservation_confirmed(self, request_id: str) -> None:
        wid, n = self.reserving.pop(request_id, (None, 0))
        if wid is not None:
            self.reserved(wid, n)

    def reserved(self, worker_id: str, num_blocks: int) -> None:
        """A reservation was confirmed: its blocks now show in the worker's own stats."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.pending_blocks = max(0, w.pending_blocks - num_blocks)

    def remove_worker(self, worker_id: str) -> list[str]:
        """Forget a worker; returns the requests it was serving (now lost)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        w.alive = False
        for rid in w.requests:
            ws = self.request_workers.get(rid)
            if ws is not None:
                ws.discard(worker_id)
        return sorted(w.requests)

    def dead_workers(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [w.worker_id for w in self.workers.values()
                if now - w.last_seen > self.config.worker_timeout_s]

    def live_workers(self, *roles: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive and (not roles or w.role in roles)]

    @property
    def max_model_len(self) -> int | None:
        if not self.live_workers("colocated", "decode"):
            return None
        lens = [w.max_model_len for w in self.live_workers()]
        return min(lens) if lens else None

    # -- admission and routing --
    def num_in_flight(self) -> int:
        return len(self.request_workers)

    def admit(self, num_new: int = 1) -> None:
        workers = self.live_workers("colocated", "decode")
        if not workers:
            raise NoWorkerAvailable("no worker is available to serve requests")
        capacity = sum(w.max_num_seqs for w in workers) + self.config.max_queued_requests
        if self.num_in_flight() + num_new > capacity:
            raise QueueFull(f"the server is at capacity ({self.num_in_flight()} requests in "
                            f"flight, limit {capacity}); retry later")

    def _assign(self, request_id: str, w: WorkerInfo) -> None:
        w.requests.add(request_id)
        self.request_workers.setdefault(request_id, set()).add(w.worker_id)

    def route(self, request_id: str, prompt_len: int) -> Route:
        """Place a new request. Disaggregated when both pools have a worker; a decode worker
        alone prefills locally; else a colocated worker."""
        decode = self.live_workers("decode")
        prefill = self.live_workers("prefill")
        if decode:
            # decode worker with the most free blocks after reservations, then fewest running
            w = min(decode, key=lambda w: (-w.free_blocks, w.stats.num_running, len(w.requests),
                                           w.worker_id))
            self._assign(request_id, w)
            local = not prefill or prompt_len < self.config.local_prefill_max_tokens
            if not local:
                self.expect_reservation(request_id, w.worker_id, prompt_len)
            return Route("local" if local else "disaggregated", w.worker_id)
        colocated = self.live_workers("colocated")
        if not colocated:
            raise NoWorkerAvailable("no worker is available to serve requests")
        w = min(colocated, key=lambda w: (len(w.requests), -w.free_blocks, w.worker_id))
        self._assign(request_id, w)
        return Route("colocated", w.worker_id)

    def route_prefill(self, request_id: str, prompt_len: int,
                      exclude: frozenset[str] = frozenset()) -> str:
        """The prefill worker with the shortest queue in tokens (its own count, plus what was
        routed to it since), avoiding `exclude` (workers that already failed this request)."""
        cands = [w for w in self.live_workers("prefill") if w.worker_id not in exclude]
        cands = cands or self.live_workers("prefill")
        if not cands:
            raise NoWorkerAvailable("no prefill worker is available")
        w = min(cands, key=lambda w: (w.queued_prefill_tokens + w.stats.prefill_queue_tokens,
                                      len(w.requests), w.worker_id))
        w.queued_prefill_tokens += prompt_len
        self._assign(request_id, w)
        self.prefill_tokens[request_id] = (w.worker_id, prompt_len)
        return w.worker_id

    def prefill_done(self, request_id: str) -> None:
        """The prefill worker is finished with this request (KV sent, or it failed)."""
        wid, n = self.prefill_tokens.pop(request_id, (None, 0))
        w = self.workers.get(wid) if wid else None
        if w is not None:
            w.queued_prefill_tokens = max(0, w.queued_prefill_tokens - n)
            w.requests.discard(request_id)
            self.request_workers.get(request_id, set()).discard(wid)

    def workers_of(self, request_id: str) -> list[str]:
        return sorted(self.request_workers.get(request_id, ()))

    def finish(self, request_id: str) -> None:
        self.reservation_confirmed(request_id)  # never confirmed: release the estimate
        self.prefill_done(request_id)
        for wid in self.request_workers.pop(request_id, ()):
            if wid in self.workers:
                self.workers[wid].requests.discard(request_id)
