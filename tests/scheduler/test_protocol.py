"""The wire protocol alone: typed channels, framing, dropping (never raising on) bad input."""

import inspect

import msgspec
import pytest

import scheduler.protocol as protocol
from scheduler.protocol import (
    GATEWAY_TO_WORKER,
    PROTOCOL_VERSION,
    TYPE_IDS,
    WORKER_TO_GATEWAY,
    AbortRequests,
    AddRequest,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    LogprobEntry,
    ModelFingerprint,
    RequestFailed,
    Shutdown,
    StepOutputs,
    TokenDelta,
    WorkerCapacity,
    WorkerStats,
    encode,
    gateway_channel,
    worker_channel,
)
from scheduler.sampling_params import SamplingParams

FP = ModelFingerprint(model="smollm2", dtype="float32", kv_dtype="float32", block_size=16,
                      num_layers=30, num_kv_heads=3, head_dim=64, vocab_size=49152)
CAP = WorkerCapacity(num_blocks=100, block_size=16, bytes_per_token=2048, max_model_len=2048,
                     max_num_seqs=8)
STATS = WorkerStats(num_running=2, num_waiting=1, num_blocks_used=10, num_blocks_total=100,
                    num_preemptions=3, num_steps=42)

WORKER_MSGS = [
    Hello(worker_id="w0", role="mixed", protocol_version=PROTOCOL_VERSION, fingerprint=FP,
          capacity=CAP, pid=1234),
    Heartbeat(worker_id="w0", stats=STATS),
    StepOutputs(worker_id="w0", stats=STATS, deltas=[
        TokenDelta("r1", [5, 6], num_prompt_tokens=3, num_output_tokens=2, queue_s=0.25,
                   prefill_s=0.5,
                   logprobs=[LogprobEntry(5, -0.5, [(5, -0.5), (9, -1.25)]),
                             LogprobEntry(6, -0.125)]),
        TokenDelta("r2", [7], finished=True, finish_reason="stop"),
    ]),
    RequestFailed(request_id="r3", message="out of memory", status=503),
    Goodbye(worker_id="w0", reason="shutdown"),
]
GATEWAY_MSGS = [
    HelloAck(accepted=False, reason="fingerprint mismatch"),
    AddRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
               params=SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40,
                                     seed=7, stop_token_ids=(2, 11), logprobs=3)),
    AbortRequests(request_ids=["r1", "r2"]),
    Shutdown(reason="bye"),
]


def test_directions_cover_every_type_exactly_once():
    assert set(WORKER_TO_GATEWAY) | set(GATEWAY_TO_WORKER) == set(TYPE_IDS)
    assert not set(WORKER_TO_GATEWAY) & set(GATEWAY_TO_WORKER)
    assert {type(m) for m in WORKER_MSGS} == set(WORKER_TO_GATEWAY)
    assert {type(m) for m in GATEWAY_MSGS} == set(GATEWAY_TO_WORKER)


def test_type_ids_unique_and_one_byte():
    ids = list(TYPE_IDS.values())
    assert len(set(ids)) == len(ids)
    assert all(0 <= i <= 255 for i in ids)
    for t, i in TYPE_IDS.items():
        assert bytes([i]) == encode(_example(t))[0]


def _example(t):
    return next(m for m in WORKER_MSGS + GATEWAY_MSGS if type(m) is t)


@pytest.mark.parametrize("msg", WORKER_MSGS, ids=lambda m: type(m).__name__)
def test_worker_to_gateway_round_trip(msg):
    ch = gateway_channel()
    frames = encode(msg)
    assert len(frames) == 2 and len(frames[0]) == 1
    out = ch.decode(frames)
    assert out is not None
    got, bufs = out
    assert type(got) is type(msg) and got == msg
    assert bufs == []
    assert ch.num_dropped == 0


@pytest.mark.parametrize("msg", GATEWAY_MSGS, ids=lambda m: type(m).__name__)
def test_gateway_to_worker_round_trip(msg):
    ch = worker_channel()
    out = ch.decode(encode(msg))
    assert out is not None
    got, bufs = out
    assert type(got) is type(msg) and got == msg
    assert bufs == []
    assert ch.num_dropped == 0


@pytest.mark.parametrize("msg", WORKER_MSGS, ids=lambda m: type(m).__name__)
def test_worker_channel_refuses_worker_to_gateway_types(msg):
    ch = worker_channel()
    assert ch.decode(encode(msg)) is None
    assert ch.num_dropped == 1


@pytest.mark.parametrize("msg", GATEWAY_MSGS, ids=lambda m: type(m).__name__)
def test_gateway_channel_refuses_gateway_to_worker_types(msg):
    ch = gateway_channel()
    assert ch.decode(encode(msg)) is None
    assert ch.num_dropped == 1


def _bad_frames():
    hb = encode(Heartbeat(worker_id="w0", stats=STATS))
    body = hb[1]
    wrong_field = msgspec.msgpack.encode(
        {"type": "heartbeat", "worker_id": 5, "stats": {}})  # worker_id must be a str
    wrong_nested = msgspec.msgpack.encode(
        {"type": "heartbeat", "worker_id": "w0", "stats": {"num_running": "many"}})
    missing_field = msgspec.msgpack.encode({"type": "heartbeat"})
    wrong_tag = encode(Goodbye(worker_id="w0"))[1]  # a Goodbye body under Heartbeat's byte
    return {
        "unknown type byte": [bytes([250]), body],
        "unused type byte 0": [bytes([0]), body],
        "two-byte type frame": [bytes([TYPE_IDS[Heartbeat], 0]), body],
        "empty type frame": [b"", body],
        "no frames": [],
        "only the type frame": [hb[0]],
        "truncated body": [hb[0], body[: len(body) // 2]],
        "garbage body": [hb[0], b"\xc1\xff\x00garbage"],
        "empty body": [hb[0], b""],
        "wrong field type": [hb[0], wrong_field],
        "wrong nested field type": [hb[0], wrong_nested],
        "missing field": [hb[0], missing_field],
        "other type's body": [hb[0], wrong_tag],
    }


@pytest.mark.parametrize("case", list(_bad_frames()))
def test_malformed_frames_are_dropped_and_counted(case):
    frames = _bad_frames()[case]
    ch = gateway_channel()
    assert ch.decode(frames) is None  # never raises
    assert ch.num_dropped == 1
    # and the channel still works afterwards
    msg = Goodbye(worker_id="w1")
    assert ch.decode(encode(msg)) == (msg, [])
    assert ch.num_dropped == 1


@pytest.mark.parametrize("msg", WORKER_MSGS, ids=lambda m: type(m).__name__)
def test_valid_body_under_a_foreign_type_byte_is_dropped(msg):
    # the type byte alone picks the decoder: an unknown byte, or one of the other
    # direction's bytes, is dropped even though the body itself is well formed
    body = encode(msg)[1]
    ch = gateway_channel()
    foreign = [0, 6, 255, *(TYPE_IDS[t] for t in GATEWAY_TO_WORKER)]
    for byte in foreign:
        assert ch.decode([bytes([byte]), body]) is None
    assert ch.num_dropped == len(foreign)


def test_drop_count_accumulates():
    ch = worker_channel()
    bad = list(_bad_frames().values())
    for frames in bad:
        assert ch.decode(frames) is None
    assert ch.decode(encode(Heartbeat(worker_id="w", stats=STATS))) is None  # wrong direction
    assert ch.num_dropped == len(bad) + 1


def test_buffer_frames_come_back_unchanged():
    raw = bytes(range(256)) * 4
    arr = bytearray(b"\x00\x01kv-bytes\xff" * 10)
    view = memoryview(arr)
    msg = AddRequest(request_id="r", prompt_token_ids=[1], params=SamplingParams())
    frames = encode(msg, [raw, view])
    assert len(frames) == 4
    out = worker_channel().decode(frames)
    assert out is not None
    got, bufs = out
    assert got == msg
    assert len(bufs) == 2
    assert bufs[0] is raw
    assert bufs[1] is view and bytes(bufs[1]) == bytes(arr)


def test_frames_as_memoryviews_decode():
    # ZMQ hands back Frame/buffer objects; the channel must accept any bytes-like frame
    msg = Goodbye(worker_id="w0", reason="x")
    frames = [memoryview(f) for f in encode(msg, [b"abc"])]
    got, bufs = gateway_channel().decode(frames)
    assert got == msg and [bytes(b) for b in bufs] == [b"abc"]


def test_sampling_params_survive_exactly():
    for params in [
        SamplingParams(),
        SamplingParams(seed=None, stop_token_ids=()),
        SamplingParams(max_tokens=1, temperature=0.0, top_p=0.5, top_k=-1, min_p=0.05,
                       presence_penalty=-2.0, frequency_penalty=1.5, repetition_penalty=1.1,
                       seed=2**64 - 1, stop_token_ids=(2, 0, 49151), ignore_eos=True,
                       min_tokens=1, logprobs=0, priority=-3),
        SamplingParams(seed=-(2**63), logprobs=None),
    ]:
        msg = AddRequest(request_id="r", prompt_token_ids=[3, 1, 4], params=params)
        got, _ = worker_channel().decode(encode(msg))
        assert got.params == params
        for f in SamplingParams.__struct_fields__:
            a, b = getattr(got.params, f), getattr(params, f)
            assert a == b and type(a) is type(b), f
        assert got.params.stop_token_ids == params.stop_token_ids
        assert isinstance(got.params.stop_token_ids, tuple)


def test_no_pickle():
    assert "pickle" not in protocol.__dict__
    src = inspect.getsource(protocol)
    assert "pickle.load" not in src
    assert "import pickle" not in src
