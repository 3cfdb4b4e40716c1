"""The gateway's global scheduler alone: membership, routing (colocated, local and
disaggregated), prefill placement, admission. No torch, no ZMQ."""

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from scheduler.global_scheduler import (
    ROLES,
    GlobalScheduler,
    GlobalSchedulerConfig,
    NoWorkerAvailable,
    QueueFull,
    Route,
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


def hello(wid, role="colocated", fp=FP, version=PROTOCOL_VERSION, max_num_seqs=4,
          max_model_len=2048, num_blocks=100, kv_endpoint=None):
    cap = WorkerCapacity(num_blocks=num_blocks, block_size=fp.block_size, bytes_per_token=1024,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if kv_endpoint is None:
        kv_endpoint = f"tcp://{wid}:5600" if role == "decode" else ""
    return Hello(worker_id=wid, role=role, protocol_version=version, fingerprint=fp,
                 capacity=cap, pid=100, kv_endpoint=kv_endpoint)


def sched(**kw):
    return GlobalScheduler(GlobalSchedulerConfig(**kw))


def stats(gs, wid, used=0, total=100, **kw):
    assert gs.seen(wid, WorkerStats(num_blocks_used=used, num_blocks_total=total, **kw), now=0.0)


def blocks_for(prompt_len, block_size=16):
    """Blocks a reservation holds: the prompt plus the first sampled token, whole blocks."""
    return (prompt_len + 1 + block_size - 1) // block_size


# ---- membership ----

def test_first_worker_sets_the_reference():
    gs = sched()
    assert gs.reference is None
    assert gs.register(hello("w0", max_num_seqs=7), now=1.0) == (True, "")
    assert gs.reference == FP
    w = gs.workers["w0"]
    assert (w.max_num_seqs, w.num_blocks, w.block_size, w.last_seen) == (7, 100, 16, 1.0)
    assert (w.role, w.kv_endpoint, w.pending_blocks, w.queued_prefill_tokens) == (
        "colocated", "", 0, 0)
    assert gs.refused == {}
    # the same fingerprint is accepted again
    assert gs.register(hello("w1"), now=1.0) == (True, "")
    assert set(gs.workers) == {"w0", "w1"}


def test_every_role_registers_and_keeps_its_endpoint():
    gs = sched()
    for role in ROLES:
        assert gs.register(hello(f"{role}0", role=role)) == (True, "")
    assert {w.worker_id: w.role for w in gs.workers.values()} == {
        "colocated0": "colocated", "prefill0": "prefill", "decode0": "decode"}
    assert gs.workers["decode0"].kv_endpoint == "tcp://decode0:5600"
    assert gs.workers["prefill0"].kv_endpoint == ""  # a prefill worker needs none


@pytest.mark.parametrize("role", ["mixed", "", "Decode", "prefill "])
def test_unknown_role_is_refused(role):
    gs = sched()
    ok, reason = gs.register(hello("w0", role=role, kv_endpoint="tcp://x:1"))
    assert not ok
    assert "unknown role" in reason and repr(role) in reason
    assert gs.refused == {"w0": reason}
    assert gs.workers == {} and gs.reference is None


def test_decode_worker_without_kv_endpoint_is_refused():
    gs = sched()
    ok, reason = gs.register(hello("d0", role="decode", kv_endpoint=""))
    assert not ok
    assert "KV endpoint" in reason
    assert gs.refused == {"d0": reason}
    assert gs.workers == {} and gs.reference is None
    # it may come back advertising one
    assert gs.register(hello("d0", role="decode", kv_endpoint="tcp://10.0.0.2:7000"))[0]
    assert gs.workers["d0"].kv_endpoint == "tcp://10.0.0.2:7000"
    assert gs.refused == {}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("changes", [
    {"dtype": "bfloat16"},
    {"block_size": 32},
    {"dtype": "float16", "vocab_size": 1},
])
def test_fingerprint_mismatch_is_refused_naming_the_fields(changes, role):
    gs = sched()
    assert gs.register(hello("w0"))[0]
    other = msgspec.structs.replace(FP, **changes)
    ok, reason = gs.register(hello("w1", role=role, fp=other))
    assert not ok
    assert "fingerprint" in reason
    for field in changes:
        assert field in reason
    named = set(re.findall(r"(\w+): ", reason))
    assert named == set(changes)  # exactly the differing fields are named
    assert gs.refused == {"w1": reason}
    assert set(gs.workers) == {"w0"}
    assert gs.reference == FP  # the refused worker did not change the reference


def test_a_prefill_worker_can_set_the_reference():
    gs = sched()
    assert gs.register(hello("p0", role="prefill"))[0]
    assert gs.reference == FP
    ok, reason = gs.register(hello("d0", role="decode",
                                   fp=msgspec.structs.replace(FP, kv_dtype="bfloat16")))
    assert not ok and "kv_dtype" in reason


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


def test_live_workers_filters_by_role():
    gs = sched()
    for wid, role in [("c0", "colocated"), ("p0", "prefill"), ("p1", "prefill"),
                      ("d0", "decode")]:
        gs.register(hello(wid, role=role))

    def ids(*roles):
        return sorted(w.worker_id for w in gs.live_workers(*roles))

    assert ids() == ["c0", "d0", "p0", "p1"]
    assert ids("prefill") == ["p0", "p1"]
    assert ids("decode") == ["d0"]
    assert ids("colocated", "decode") == ["c0", "d0"]
    assert ids("nope") == []
    gs.remove_worker("p0")
    assert ids("prefill") == ["p1"]


# ---- colocated routing ----

def test_route_prefers_fewest_requests_then_most_free_blocks():
    gs = sched()
    for wid in ("a", "b", "c"):
        gs.register(hello(wid), now=0.0)
    stats(gs, "a", used=90)  # 10 free
    stats(gs, "b", used=20)  # 80 free
    stats(gs, "c", used=50)  # 50 free
    assert [gs.workers[w].free_blocks for w in "abc"] == [10, 80, 50]

    def route(rid):
        r = gs.route(rid, 100)
        assert r.kind == "colocated"
        return r.worker

    # all empty: most free blocks wins
    assert gs.route("r1", 100) == Route("colocated", "b")
    # b now has one request: among a and c (none), c has more free blocks
    assert route("r2") == "c"
    assert route("r3") == "a"
    # all have one: b again (most free)
    assert route("r4") == "b"
    assert gs.request_workers == {"r1": {"b"}, "r2": {"c"}, "r3": {"a"}, "r4": {"b"}}
    assert gs.workers["b"].requests == {"r1", "r4"}
    assert gs.workers_of("r1") == ["b"]
    assert gs.num_in_flight() == 4
    assert route("r5") == "c"  # a and c tie on requests; c has more free blocks
    # fewest requests beats free blocks: a (1 request, 10 free) over b, c (2 requests each)
    assert route("r6") == "a"
    gs.finish("r2")  # c drops to 1 request, the only worker with fewer than 2
    assert route("r7") == "c"
    # colocated routing never reserves anything
    assert all(w.pending_blocks == 0 for w in gs.workers.values())


@pytest.mark.parametrize("role", ["colocated", "decode"])
def test_full_ties_break_by_id(role):
    gs = sched()
    for wid in ("b0", "a9"):  # the smaller id, not the first registered nor reversed
        gs.register(hello(wid, role=role))
        stats(gs, wid, used=10)
    assert gs.route("r1", 5).worker == "a9"
    assert gs.route("r2", 5).worker == "b0"
    assert gs.route("r3", 5).worker == "a9"


def test_finish_releases_the_assignment():
    gs = sched()
    gs.register(hello("a"))
    gs.register(hello("b"))
    wid = gs.route("r1", 10).worker
    assert gs.workers[wid].requests == {"r1"}
    gs.finish("r1")
    assert gs.workers[wid].requests == set()
    assert "r1" not in gs.request_workers
    assert gs.workers_of("r1") == []
    assert gs.num_in_flight() == 0
    gs.finish("r1")  # twice, or unknown: harmless
    gs.finish("nope")


# ---- decode routing: local and disaggregated ----

def test_route_kind_by_pool():
    # colocated only
    gs = sched()
    gs.register(hello("c0"))
    assert gs.route("r", 100) == Route("colocated", "c0")
    # a decode worker without prefill workers prefills itself: nothing is reserved
    gs = sched()
    gs.register(hello("d0", role="decode"))
    stats(gs, "d0")
    assert gs.route("r", 100) == Route("local", "d0")
    assert gs.workers["d0"].pending_blocks == 0
    # both pools: reserve on the decode worker
    gs.register(hello("p0", role="prefill"))
    assert gs.route("r2", 100) == Route("disaggregated", "d0")
    assert gs.workers["d0"].pending_blocks == blocks_for(100) == 7
    # the decode worker holds the request; the prefill worker is only picked later
    assert gs.workers_of("r2") == ["d0"]
    assert gs.workers["p0"].requests == set()
    assert gs.workers["p0"].queued_prefill_tokens == 0


def test_colocated_workers_get_nothing_while_a_decode_worker_is_up():
    gs = sched()
    gs.register(hello("c0"))
    gs.register(hello("d0", role="decode"))
    assert gs.route("r1", 10) == Route("local", "d0")
    gs.register(hello("p0", role="prefill"))
    assert gs.route("r2", 10) == Route("disaggregated", "d0")
    assert gs.workers["c0"].requests == set()
    gs.remove_worker("d0")
    assert gs.route("r3", 10) == Route("colocated", "c0")


def test_colocated_and_prefill_without_decode_route_colocated():
    gs = sched()
    gs.register(hello("p0", role="prefill"))
    gs.register(hello("c0"))
    assert gs.route("r", 1000) == Route("colocated", "c0")
    assert gs.workers["p0"].requests == set()


@pytest.mark.parametrize("prompt_len", [0, 1, 14, 15, 16, 31, 32, 33, 1000])
def test_disaggregated_reserves_prompt_plus_one_token_in_whole_blocks(prompt_len):
    gs = sched()
    gs.register(hello("d0", role="decode"))
    gs.register(hello("p0", role="prefill"))
    stats(gs, "d0", used=0, total=1000)
    assert gs.route("r", prompt_len).kind == "disaggregated"
    expect = -(-(prompt_len + 1) // 16)
    assert gs.workers["d0"].pending_blocks == expect
    assert gs.workers["d0"].free_blocks == 1000 - expect
    gs.route("r2", prompt_len)
    assert gs.workers["d0"].pending_blocks == 2 * expect  # reservations add up


def test_reservation_uses_the_workers_block_size():
    fp = msgspec.structs.replace(FP, block_size=32)
    gs = sched()
    gs.register(hello("d0", role="decode", fp=fp))
    gs.register(hello("p0", role="prefill", fp=fp))
    gs.route("r", 40)  # 41 tokens: 2 blocks of 32 (3 of 16)
    assert gs.workers["d0"].pending_blocks == 2


@pytest.mark.parametrize("prompt_len,kind", [
    (0, "local"), (7, "local"), (8, "disaggregated"), (500, "disaggregated")])
def test_short_prompts_prefill_locally(prompt_len, kind):
    gs = sched(local_prefill_max_tokens=8)
    gs.register(hello("d0", role="decode"))
    gs.register(hello("p0", role="prefill"))
    assert gs.route("r", prompt_len) == Route(kind, "d0")
    assert gs.workers["d0"].pending_blocks == (
        blocks_for(prompt_len) if kind == "disaggregated" else 0)


def test_decode_choice_most_free_blocks_after_reservations():
    gs = sched()
    gs.register(hello("d1", role="decode"))
    gs.register(hello("d2", role="decode"))
    gs.register(hello("p0", role="prefill"))
    stats(gs, "d1", used=20)  # 80 free
    stats(gs, "d2", used=30)  # 70 free
    assert gs.route("r1", 319) == Route("disaggregated", "d1")  # 20 blocks: d1 -> 60 free
    assert gs.workers["d1"].free_blocks == 60
    assert gs.route("r2", 319).worker == "d2"  # 70 > 60; d2 -> 50
    assert gs.route("r3", 319).worker == "d1"  # 60 > 50; d1 -> 40
    assert (gs.workers["d1"].pending_blocks, gs.workers["d2"].pending_blocks) == (40, 20)
    # d1 confirms both reservations: they move from pending into its own stats
    gs.reserved("d1", 20)
    gs.reserved("d1", 20)
    stats(gs, "d1", used=60)
    assert gs.workers["d1"].pending_blocks == 0
    assert gs.workers["d1"].free_blocks == 40
    assert gs.workers["d2"].free_blocks == 50
    assert gs.route("r4", 15).worker == "d2"


def test_decode_ties_fewest_running_then_fewest_requests_then_id():
    gs = sched()
    for wid in ("d2", "d1", "d3"):
        gs.register(hello(wid, role="decode"))
        stats(gs, wid, used=50)
    # all equal: the smallest id
    assert gs.route("r1", 10) == Route("local", "d1")
    # equal free and running: fewest requests
    assert gs.route("r2", 10).worker == "d2"
    assert gs.route("r3", 10).worker == "d3"
    assert gs.route("r4", 10).worker == "d1"
    # fewer running beats fewer requests: d1 has 2 requests but runs nothing
    stats(gs, "d2", used=50, num_running=3)
    stats(gs, "d3", used=50, num_running=3)
    assert gs.route("r5", 10).worker == "d1"
    # more free blocks beats fewer running
    stats(gs, "d2", used=49, num_running=9)
    assert gs.route("r6", 10).worker == "d2"
    # colocated-style "fewest requests first" does not apply to decode workers
    assert len(gs.workers["d2"].requests) > len(gs.workers["d3"].requests)


def test_reserved_lowers_pending_never_below_zero():
    gs = sched()
    gs.register(hello("d0", role="decode"))
    gs.register(hello("p0", role="prefill"))
    gs.route("r1", 100)  # 7 blocks
    gs.route("r2", 20)  # 2 blocks
    assert gs.workers["d0"].pending_blocks == 9
    gs.reserved("d0", 7)
    assert gs.workers["d0"].pending_blocks == 2
    gs.reserved("d0", 5)
    assert gs.workers["d0"].pending_blocks == 0
    gs.reserved("ghost", 3)  # unknown worker: harmless
    gs.reserved("p0", 3)
    assert gs.workers["p0"].pending_blocks == 0


# ---- prefill placement ----

def _pd(prefill=("p1", "p2"), decode=("d0",), **kw):
    gs = sched(**kw)
    for wid in decode:
        gs.register(hello(wid, role="decode"))
        stats(gs, wid, used=0, total=1000)
    for wid in prefill:
        gs.register(hello(wid, role="prefill"))
    return gs


def test_route_prefill_without_prefill_workers():
    gs = _pd(prefill=())
    assert gs.route("r", 100).kind == "local"
    with pytest.raises(NoWorkerAvailable):
        gs.route_prefill("r", 100)
    assert gs.workers_of("r") == ["d0"]
    assert gs.prefill_tokens == {}


def test_route_prefill_shortest_token_queue():
    gs = _pd()
    stats(gs, "p1", prefill_queue_tokens=100)  # the worker's own count
    assert gs.route("a", 150).kind == "disaggregated"
    assert gs.route_prefill("a", 150) == "p2"  # 0 < 100
    assert gs.workers["p2"].queued_prefill_tokens == 150
    assert gs.prefill_tokens == {"a": ("p2", 150)}
    assert gs.workers_of("a") == ["d0", "p2"]  # state on both
    assert gs.num_in_flight() == 1  # still one request
    for rid in ("b", "c"):
        gs.route(rid, 20)
    assert gs.route_prefill("b", 20) == "p1"  # 100 < 150
    assert gs.route_prefill("c", 20) == "p1"  # 120 < 150
    assert gs.route_prefill("d", 40) == "p1"  # 140 < 150 (p1 now at 180)
    assert gs.route_prefill("e", 1) == "p2"  # 150 < 180
    assert (gs.workers["p1"].queued_prefill_tokens, gs.workers["p2"].queued_prefill_tokens) == (
        80, 151)
    # the worker's own count drops (its queue drained): that alone moves the choice back
    stats(gs, "p1", prefill_queue_tokens=0)
    assert gs.route_prefill("f", 1) == "p1"  # 80 < 151


def test_route_prefill_ties_fewest_requests_then_id():
    gs = _pd(prefill=("p2", "p1", "p3"))
    assert gs.route_prefill("a", 0) == "p1"  # all at 0 tokens and 0 requests: smallest id
    assert gs.route_prefill("b", 0) == "p2"  # 0 tokens each; p1 has a request
    assert gs.route_prefill("c", 0) == "p3"
    assert gs.route_prefill("d", 0) == "p1"
    gs = _pd(prefill=("q0", "p9"))
    assert gs.route_prefill("a", 5) == "p9"


def test_workers_of_is_sorted():
    gs = _pd(prefill=("p1",), decode=("d0",))
    gs.route("r", 10)
    gs.route_prefill("r", 10)
    assert gs.workers_of("r") == ["d0", "p1"]
    assert gs.workers_of("unknown") == []
    # set order is arbitrary (hash-seeded): many holders make an accidental order unlikely
    holders = {f"w{i:02d}" for i in range(20)}
    gs.request_workers["many"] = set(holders)
    assert gs.workers_of("many") == sorted(holders)


def test_prefill_done_releases_the_prefill_side_only():
    gs = _pd()
    gs.route("a", 64)
    gs.route("b", 32)
    assert gs.route_prefill("a", 64) == "p1"
    assert gs.route_prefill("b", 32) == "p2"
    assert gs.route_prefill("x", 8) == "p2"  # a request with no decode side
    assert gs.workers["p2"].queued_prefill_tokens == 40
    gs.prefill_done("a")
    assert gs.workers["p1"].queued_prefill_tokens == 0
    assert gs.workers["p1"].requests == set()
    assert gs.workers_of("a") == ["d0"]  # still decoding
    assert gs.workers["d0"].requests == {"a", "b"}
    assert "a" not in gs.prefill_tokens
    assert gs.num_in_flight() == 3
    # twice, or unknown: harmless, and p2's accounting is untouched
    gs.prefill_done("a")
    gs.prefill_done("nope")
    assert gs.workers["p2"].queued_prefill_tokens == 40
    assert gs.workers["p2"].requests == {"b", "x"}
    # the released tokens count again for the next choice: p1 is empty now
    assert gs.route_prefill("c", 1) == "p1"


def test_route_prefill_avoids_excluded_workers_unless_none_is_left():
    gs = _pd()
    stats(gs, "p1", prefill_queue_tokens=1000)
    gs.route("r", 100)
    assert gs.route_prefill("r", 100, exclude=frozenset({"p2"})) == "p1"  # longer queue
    # the prefill failed on p1: retry elsewhere
    gs.prefill_done("r")
    assert gs.workers["p1"].queued_prefill_tokens == 0
    assert gs.route_prefill("r", 100, exclude=frozenset({"p1"})) == "p2"
    assert gs.workers_of("r") == ["d0", "p2"]
    assert gs.prefill_tokens["r"] == ("p2", 100)
    gs.prefill_done("r")
    # every prefill worker excluded: the best one is still used rather than failing
    assert gs.route_prefill("r", 100, exclude=frozenset({"p1", "p2"})) == "p2"
    gs.prefill_done("r")
    gs.remove_worker("p2")
    assert gs.route_prefill("r", 100, exclude=frozenset({"p1"})) == "p1"


def test_finish_releases_everything():
    gs = _pd()
    gs.route("r", 100)
    gs.route("other", 100)
    assert gs.route_prefill("r", 100) == "p1"
    assert gs.route_prefill("other", 100) == "p2"
    gs.finish("r")
    assert gs.workers_of("r") == []
    assert "r" not in gs.request_workers and "r" not in gs.prefill_tokens
    assert gs.workers["p1"].requests == set()
    assert gs.workers["p1"].queued_prefill_tokens == 0
    assert gs.workers["d0"].requests == {"other"}
    # the other request keeps its state
    assert gs.workers_of("other") == ["d0", "p2"]
    assert gs.workers["p2"].queued_prefill_tokens == 100
    assert gs.num_in_flight() == 1
    gs.finish("r")  # twice: harmless


# ---- admission ----

def test_admit_without_workers():
    gs = sched()
    with pytest.raises(NoWorkerAvailable):
        gs.admit()
    with pytest.raises(NoWorkerAvailable):
        gs.route("r", 10)
    assert gs.num_in_flight() == 0


def test_only_prefill_workers_serve_nothing():
    gs = sched()
    gs.register(hello("p0", role="prefill", max_num_seqs=64))
    with pytest.raises(NoWorkerAvailable):
        gs.admit()
    with pytest.raises(NoWorkerAvailable):
        gs.route("r", 10)
    assert gs.max_model_len is None
    assert gs.num_in_flight() == 0 and gs.workers["p0"].requests == set()
    # a decode worker makes the system serve
    gs.register(hello("d0", role="decode"))
    gs.admit()
    assert gs.route("r", 10) == Route("disaggregated", "d0")


def test_admit_queue_full_at_capacity():
    gs = sched(max_queued_requests=3)
    gs.register(hello("a", max_num_seqs=2))
    gs.register(hello("b", max_num_seqs=4))
    capacity = 2 + 4 + 3
    for i in range(capacity):
        gs.admit()
        gs.route(f"r{i}", 10)
    assert gs.num_in_flight() == capacity
    with pytest.raises(QueueFull) as ei:
        gs.admit()
    assert ei.value.retry_after_s >= 1
    assert str(capacity) in str(ei.value)
    gs.finish("r0")
    gs.admit()  # room for one again
    with pytest.raises(QueueFull):
        gs.admit(num_new=2)


def test_admit_capacity_counts_decode_not_prefill_workers():
    gs = sched(max_queued_requests=1)
    gs.register(hello("d0", role="decode", max_num_seqs=2))
    gs.register(hello("p0", role="prefill", max_num_seqs=50))
    capacity = 2 + 1  # the prefill worker's sequences are not decode slots
    for i in range(capacity):
        gs.admit()
        gs.route(f"r{i}", 10)
        gs.route_prefill(f"r{i}", 10)
    # a request held on two workers is counted once
    assert gs.num_in_flight() == capacity
    with pytest.raises(QueueFull) as ei:
        gs.admit()
    assert str(capacity) in str(ei.value)
    gs.prefill_done("r0")  # the prefill side finishing frees no slot
    with pytest.raises(QueueFull):
        gs.admit()
    gs.finish("r0")
    gs.admit()


# ---- liveness and removal ----

def test_dead_workers_by_last_seen():
    gs = sched(worker_timeout_s=10.0)
    gs.register(hello("a"), now=100.0)
    gs.register(hello("b"), now=100.0)
    gs.register(hello("p", role="prefill"), now=100.0)
    assert gs.dead_workers(now=105.0) == []
    assert gs.seen("b", None, now=108.0)
    assert gs.seen("p", None, now=108.0)
    assert gs.dead_workers(now=110.0) == []  # exactly the timeout is not yet dead
    assert gs.dead_workers(now=110.5) == ["a"]
    assert sorted(gs.dead_workers(now=118.5)) == ["a", "b", "p"]
    # seen() with stats refreshes both last_seen and the stats
    st = WorkerStats(num_running=3, prefill_queue_tokens=7, num_reserved_blocks=2)
    assert gs.seen("a", st, now=118.0)
    assert gs.workers["a"].stats == st
    assert sorted(gs.dead_workers(now=118.5)) == ["b", "p"]


def test_remove_worker_returns_its_requests_sorted():
    gs = sched()
    gs.register(hello("a"))
    for rid in ("r9", "r1", "r10", "r5"):
        assert gs.route(rid, 10) == Route("colocated", "a")
    gs.finish("r10")
    gs.register(hello("b"))
    assert gs.route("other", 10).worker == "b"  # b has fewer requests
    lost = gs.remove_worker("a")
    assert lost == ["r1", "r5", "r9"]
    assert all(gs.workers_of(rid) == [] for rid in lost)
    assert gs.workers_of("other") == ["b"]
    assert "a" not in gs.workers
    assert gs.remove_worker("a") == []  # idempotent
    assert gs.seen("a", None) is False  # a removed worker is unknown
    assert gs.route("next", 10).worker == "b"
    for rid in lost:  # the gateway fails the lost requests
        gs.finish(rid)
    assert gs.request_workers == {"other": {"b"}, "next": {"b"}}


def test_remove_prefill_worker_keeps_the_decode_side():
    gs = _pd()
    for rid in ("r2", "r1", "r3"):
        gs.route(rid, 50)
    assert gs.route_prefill("r2", 50) == "p1"
    assert gs.route_prefill("r1", 10) == "p2"
    assert gs.route_prefill("r3", 10) == "p2"  # 20 < 50
    assert gs.remove_worker("p2") == ["r1", "r3"]
    assert gs.workers_of("r1") == ["d0"] and gs.workers_of("r3") == ["d0"]
    assert gs.workers_of("r2") == ["d0", "p1"]
    assert gs.workers["d0"].requests == {"r1", "r2", "r3"}
    # the retry releases the dead worker's accounting and goes to the live one
    gs.prefill_done("r1")
    assert "r1" not in gs.prefill_tokens
    assert gs.route_prefill("r1", 10, exclude=frozenset({"p2"})) == "p1"
    assert gs.workers["p1"].queued_prefill_tokens == 60
    assert gs.workers_of("r1") == ["d0", "p1"]
    assert gs.num_in_flight() == 3


def test_remove_decode_worker_keeps_the_prefill_side():
    gs = _pd(decode=("d0", "d1"))
    stats(gs, "d1", used=500, total=1000)
    gs.route("r", 50)
    assert gs.workers_of("r") == ["d0"]
    assert gs.route_prefill("r", 50) == "p1"
    assert gs.remove_worker("d0") == ["r"]
    assert gs.workers_of("r") == ["p1"]  # the gateway still has to abort it there
    assert gs.workers["d1"].requests == set()
    gs.finish("r")
    assert gs.workers["p1"].requests == set()
    assert gs.workers["p1"].queued_prefill_tokens == 0
    assert gs.num_in_flight() == 0


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


def test_max_model_len_needs_a_serving_worker():
    gs = sched()
    gs.register(hello("p0", role="prefill", max_model_len=8192))
    assert gs.max_model_len is None  # prefill workers alone serve nothing
    gs.register(hello("d0", role="decode", max_model_len=4096))
    assert gs.max_model_len == 4096
    # a prompt must also fit the prefill worker it is sent to
    gs.register(hello("p1", role="prefill", max_model_len=1024))
    assert gs.max_model_len == 1024
    gs.remove_worker("d0")
    assert gs.max_model_len is None


@pytest.mark.parametrize("module", [
    "scheduler.global_scheduler", "scheduler.batch_policy", "scheduler.protocol"])
def test_module_does_not_import_torch(module):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def test_unconfirmed_reservation_estimates_are_released():
    gs = sched()
    gs.register(hello("d0", "decode"))
    gs.register(hello("p0", "prefill"))
    stats(gs, "d0", used=0, total=100)
    assert gs.route("r1", 159).kind == "disaggregated"
    assert gs.workers["d0"].pending_blocks == 10 and gs.workers["d0"].free_blocks == 90
    gs.finish("r1")  # aborted before the worker confirmed the reservation
    assert gs.workers["d0"].pending_blocks == 0 and gs.workers["d0"].free_blocks == 100
    gs.route("r2", 159)
    gs.route("r3", 31)
    gs.reservation_confirmed("r2")
    assert gs.workers["d0"].pending_blocks == 2  # only r3's estimate is left
    gs.expect_reservation("r3", "d0", 31)  # a retry replaces, never adds to, the estimate
    assert gs.workers["d0"].pending_blocks == 2
    gs.finish("r3")
    gs.finish("r2")
    assert gs.workers["d0"].pending_blocks == 0
