"""The gateway's global scheduler alone: membership, routing, admission. No torch, no ZMQ."""

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from scheduler.global_scheduler import (
    GlobalScheduler,
    GlobalSchedulerConfig,
    NoWorkerAvailable,
    QueueFull,
)
from scheduler.protocol import (
    PROTOCOL_VERSION,
    Hello,
    ModelFingerprint,
    WorkerCapacity,
    WorkerStats,
)

ROOT = Path(__file__).resolve().parents[2]

FP = ModelFingerprint(model="smollm2", dtype="float32", kv_dtype="float32", block_size=16,
                      num_layers=30, num_kv_heads=3, head_dim=64, vocab_size=49152)


def hello(wid, fp=FP, version=PROTOCOL_VERSION, max_num_seqs=4, max_model_len=2048,
          num_blocks=100):
    cap = WorkerCapacity(num_blocks=num_blocks, block_size=fp.block_size, bytes_per_token=1024,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    return Hello(worker_id=wid, role="mixed", protocol_version=version, fingerprint=fp,
                 capacity=cap, pid=100)


def sched(**kw):
    return GlobalScheduler(GlobalSchedulerConfig(**kw))


def test_first_worker_sets_the_reference():
    gs = sched()
    assert gs.reference is None
    assert gs.register(hello("w0", max_num_seqs=7), now=1.0) == (True, "")
    assert gs.reference == FP
    w = gs.workers["w0"]
    assert (w.max_num_seqs, w.num_blocks, w.block_size, w.last_seen) == (7, 100, 16, 1.0)
    assert gs.refused == {}
    # the same fingerprint is accepted again
    assert gs.register(hello("w1"), now=1.0) == (True, "")
    assert set(gs.workers) == {"w0", "w1"}


@pytest.mark.parametrize("changes", [
    {"dtype": "bfloat16"},
    {"block_size": 32},
    {"dtype": "float16", "vocab_size": 1},
])
def test_fingerprint_mismatch_is_refused_naming_the_fields(changes):
    gs = sched()
    assert gs.register(hello("w0"))[0]
    other = msgspec.structs.replace(FP, **changes)
    ok, reason = gs.register(hello("w1", fp=other))
    assert not ok
    assert "fingerprint" in reason
    for field in changes:
        assert field in reason
    named = set(re.findall(r"(\w+): ", reason))
    assert named == set(changes)  # exactly the differing fields are named
    assert gs.refused == {"w1": reason}
    assert set(gs.workers) == {"w0"}
    assert gs.reference == FP  # the refused worker did not change the reference


def test_wrong_protocol_version_is_refused():
    gs = sched()
    ok, reason = gs.register(hello("w0", version=PROTOCOL_VERSION + 1))
    assert not ok
    assert "protocol version" in reason and str(PROTOCOL_VERSION + 1) in reason
    assert "w0" in gs.refused and gs.workers == {}
    assert gs.reference is None  # a refused first worker sets no reference
    # it may come back with the right version; the refusal is then forgotten
    assert gs.register(hello("w0"))[0]
    assert gs.refused == {}


def test_route_prefers_fewest_requests_then_most_free_blocks():
    gs = sched()
    for wid in ("a", "b", "c"):
        gs.register(hello(wid), now=0.0)
    gs.seen("a", WorkerStats(num_blocks_used=90, num_blocks_total=100), now=0.0)  # 10 free
    gs.seen("b", WorkerStats(num_blocks_used=20, num_blocks_total=100), now=0.0)  # 80 free
    gs.seen("c", WorkerStats(num_blocks_used=50, num_blocks_total=100), now=0.0)  # 50 free
    # all empty: most free blocks wins
    assert gs.route("r1") == "b"
    # b now has one request: among a and c (none), c has more free blocks
    assert gs.route("r2") == "c"
    assert gs.route("r3") == "a"
    # all have one: b again (most free)
    assert gs.route("r4") == "b"
    assert gs.request_worker == {"r1": "b", "r2": "c", "r3": "a", "r4": "b"}
    assert gs.workers["b"].requests == {"r1", "r4"}
    assert gs.num_in_flight() == 4
    assert gs.route("r5") == "c"  # a and c tie on requests; c has more free blocks
    # fewest requests beats free blocks: a (1 request, 10 free) over b, c (2 requests each)
    assert gs.route("r6") == "a"
    gs.finish("r2")  # c drops to 1 request, the only worker with fewer than 2
    assert gs.route("r7") == "c"


def test_finish_releases_the_assignment():
    gs = sched()
    gs.register(hello("a"))
    gs.register(hello("b"))
    wid = gs.route("r1")
    assert gs.workers[wid].requests == {"r1"}
    gs.finish("r1")
    assert gs.workers[wid].requests == set()
    assert "r1" not in gs.request_worker
    assert gs.num_in_flight() == 0
    gs.finish("r1")  # twice, or unknown: harmless
    gs.finish("nope")


def test_admit_without_workers():
    gs = sched()
    with pytest.raises(NoWorkerAvailable):
        gs.admit()
    with pytest.raises(NoWorkerAvailable):
        gs.route("r")


def test_admit_queue_full_at_capacity():
    gs = sched(max_queued_requests=3)
    gs.register(hello("a", max_num_seqs=2))
    gs.register(hello("b", max_num_seqs=4))
    capacity = 2 + 4 + 3
    for i in range(capacity):
        gs.admit()
        gs.route(f"r{i}")
    assert gs.num_in_flight() == capacity
    with pytest.raises(QueueFull) as ei:
        gs.admit()
    assert ei.value.retry_after_s >= 1
    assert str(capacity) in str(ei.value)
    gs.finish("r0")
    gs.admit()  # room for one again
    with pytest.raises(QueueFull):
        gs.admit(num_new=2)


def test_dead_workers_by_last_seen():
    gs = sched(worker_timeout_s=10.0)
    gs.register(hello("a"), now=100.0)
    gs.register(hello("b"), now=100.0)
    assert gs.dead_workers(now=105.0) == []
    assert gs.seen("b", None, now=108.0)
    assert gs.dead_workers(now=110.0) == []  # exactly the timeout is not yet dead
    assert gs.dead_workers(now=110.5) == ["a"]
    assert sorted(gs.dead_workers(now=118.5)) == ["a", "b"]
    # seen() with stats refreshes both last_seen and the stats
    st = WorkerStats(num_running=3)
    assert gs.seen("a", st, now=118.0)
    assert gs.workers["a"].stats == st
    assert gs.dead_workers(now=118.5) == ["b"]


def test_remove_worker_returns_its_requests_sorted():
    gs = sched()
    gs.register(hello("a"))
    for rid in ("r9", "r1", "r10", "r5"):
        assert gs.route(rid) == "a"
    gs.finish("r10")
    gs.register(hello("b"))
    assert gs.route("other") == "b"  # b has fewer requests
    assert gs.remove_worker("a") == ["r1", "r5", "r9"]
    assert gs.request_worker == {"other": "b"}
    assert "a" not in gs.workers
    assert gs.remove_worker("a") == []  # idempotent
    assert gs.seen("a", None) is False  # a removed worker is unknown
    assert gs.route("next") == "b"


def test_seen_unknown_worker():
    gs = sched()
    assert gs.seen("ghost", WorkerStats(), now=1.0) is False
    assert gs.workers == {}


def test_max_model_len_is_min_over_live_workers():
    gs = sched()
    assert gs.max_model_len is None
    gs.register(hello("a", max_model_len=4096))
    assert gs.max_model_len == 4096
    gs.register(hello("b", max_model_len=1024))
    gs.register(hello("c", max_model_len=2048))
    assert gs.max_model_len == 1024
    gs.remove_worker("b")
    assert gs.max_model_len == 2048
    gs.remove_worker("a")
    gs.remove_worker("c")
    assert gs.max_model_len is None


@pytest.mark.parametrize("module", [
    "scheduler.global_scheduler", "scheduler.batch_policy", "scheduler.protocol"])
def test_module_does_not_import_torch(module):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
