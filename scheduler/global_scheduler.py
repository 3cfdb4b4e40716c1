"""The gateway's decisions: which workers are admitted, which one serves a request, and
whether a request is admitted at all. Pure Python; the asyncio/ZMQ plumbing that carries
these decisions out lives in `server/engine_client.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.protocol import PROTOCOL_VERSION, Hello, ModelFingerprint, WorkerStats


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
    stats: WorkerStats = field(default_factory=WorkerStats)
    requests: set[str] = field(default_factory=set)
    alive: bool = True


@dataclass(frozen=True)
class GlobalSchedulerConfig:
    max_queued_requests: int = 1024  # beyond what the workers can run at once
    worker_timeout_s: float = 15.0  # no message for this long: the worker is dead


class GlobalScheduler:
    def __init__(self, config: GlobalSchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerInfo] = {}
        self.reference: ModelFingerprint | None = None  # the first admitted worker's
        self.refused: dict[str, str] = {}  # worker id -> why
        self.request_worker: dict[str, str] = {}

    # -- membership --
    def register(self, hello: Hello, now: float | None = None) -> tuple[bool, str]:
        if hello.protocol_version != PROTOCOL_VERSION:
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
            last_seen=time.monotonic() if now is None else now,
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

    def remove_worker(self, worker_id: str) -> list[str]:
        """Forget a worker; returns the requests it was serving (now lost)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        w.alive = False
        for rid in w.requests:
            self.request_worker.pop(rid, None)
        return sorted(w.requests)

    def dead_workers(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [w.worker_id for w in self.workers.values()
                if now - w.last_seen > self.config.worker_timeout_s]

    def live_workers(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive]

    @property
    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.live_workers()]
        return min(lens) if lens else None

    # -- admission and routing --
    def num_in_flight(self) -> int:
        return len(self.request_worker)

    def admit(self, num_new: int = 1) -> None:
        workers = self.live_workers()
        if not workers:
            raise NoWorkerAvailable("no worker is available to serve requests")
        capacity = sum(w.max_num_seqs for w in workers) + self.config.max_queued_requests
        if self.num_in_flight() + num_new > capacity:
            raise QueueFull(f"the server is at capacity ({self.num_in_flight()} requests in "
                            f"flight, limit {capacity}); retry later")

    def route(self, request_id: str) -> str:
        """Pick the worker for a new request: fewest requests assigned, then most free blocks."""
        workers = self.live_workers()
        if not workers:
            raise NoWorkerAvailable("no worker is available to serve requests")
        w = min(workers, key=lambda w: (len(w.requests),
                                        -(w.stats.num_blocks_total - w.stats.num_blocks_used),
                                        w.worker_id))
        w.requests.add(request_id)
        self.request_worker[request_id] = w.worker_id
        return w.worker_id

    def finish(self, request_id: str) -> None:
        wid = self.request_worker.pop(request_id, None)
        if wid is not None and wid in self.workers:
            self.workers[wid].requests.discard(request_id)
