"""The wire protocol alone: typed channels, framing, dropping (never raising on) bad input."""

import inspect

import msgspec
import pytest

import scheduler.protocol as protocol
from scheduler.protocol import (
    GATEWAY_TO_WORKER,
    PREFILL_TO_DECODE,
    PROTOCOL_VERSION,
    TYPE_IDS,
    WORKER_TO_GATEWAY,
    AbortRequests,
    AddRequest,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    KVCommit,
    KVLayer,
    KVTransferDone,
    LogprobEntry,
    ModelFingerprint,
    PrefillRequest,
    RequestFailed,
    ReservationExpired,
    Reserved,
    ReserveRequest,
    Shutdown,
    StepOutputs,
    TokenDelta,
    WorkerCapacity,
    WorkerStats,
    encode,
    gateway_channel,
    kv_channel,
    worker_channel,
)
from scheduler.sampling_params import SamplingParams

FP = ModelFingerprint(model="smollm2", dtype="float32", kv_dtype="float32", block_size=16,
                      num_layers=30, num_kv_heads=3, head_dim=64, vocab_size=49152)
CAP = WorkerCapacity(num_blocks=100, block_size=16, bytes_per_token=2048, max_model_len=2048,
                     max_num_seqs=8)
STATS = WorkerStats(num_running=2, num_waiting=1, num_blocks_used=10, num_blocks_total=100,
                    num_preemptions=3, num_steps=42, num_reserved_blocks=5,
                    prefill_queue_tokens=777, kv_bytes_received=2**40 + 3,
                    kv_transfer_failures=2)
PARAMS = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=7,
                        stop_token_ids=(2, 11), logprobs=3)

WORKER_MSGS = [
    Hello(worker_id="w0", role="decode", protocol_version=PROTOCOL_VERSION, fingerprint=FP,
          capacity=CAP, pid=1234, kv_endpoint="tcp://10.0.0.7:5601"),
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
    Reserved(request_id="r4", num_blocks=13, expires_in_s=30.0),
    ReservationExpired(request_id="r5", reason="KV did not arrive within 30s"),
    KVTransferDone(request_id="r6", num_bytes=2**33 + 1, seconds=0.0125, exposed_seconds=0.004),
]
GATEWAY_MSGS = [
    HelloAck(accepted=False, reason="fingerprint mismatch"),
    AddRequest(request_id="r1", prompt_token_ids=[1, 2, 3], params=PARAMS),
    AbortRequests(request_ids=["r1", "r2"]),
    Shutdown(reason="bye"),
    ReserveRequest(request_id="r4", prompt_token_ids=[4, 5, 6, 7], params=PARAMS),
    PrefillRequest(request_id="r4", prompt_token_ids=[4, 5, 6, 7], params=PARAMS,
                   decode_worker_id="d1", kv_endpoint="tcp://10.0.0.7:5601"),
]
KV_MSGS = [
    KVLayer(request_id="r4", layer=29, num_tokens=20, num_blocks=2, dtype="bfloat16",
            block_shape=(16, 3, 64), nbytes=12288, checksum=0xDEADBEEF,
            sent_at=1_700_000_000.25),
    KVCommit(request_id="r4", num_layers=30, first_token=49151,
             first_logprob=LogprobEntry(49151, -0.75, [(49151, -0.75), (0, -2.5)]),
             compute_done_at=1_700_000_000.5),
    KVCommit(request_id="r5", num_layers=30, first_token=0),
]
ALL_MSGS = WORKER_MSGS + GATEWAY_MSGS + KV_MSGS

# (channel factory, the direction it accepts, its sample messages)
CHANNELS = {
    "gateway": (gateway_channel, WORKER_TO_GATEWAY, WORKER_MSGS),
    "worker": (worker_channel, GATEWAY_TO_WORKER, GATEWAY_MSGS),
    "kv": (kv_channel, PREFILL_TO_DECODE, KV_MSGS),
}
# (channel name, a message of a type it does not accept)
FOREIGN = [(name, m) for name, (_, types, _) in CHANNELS.items()
           for m in ALL_MSGS if type(m) not in types]
UNUSED_BYTES = [0, 9, 15, 22, 31, 34, 128, 255]


def _id(m):
    return type(m).__name__


def test_directions_cover_every_type_exactly_once():
    directions = [WORKER_TO_GATEWAY, GATEWAY_TO_WORKER, PREFILL_TO_DECODE]
    listed = [t for d in directions for t in d]
    assert len(listed) == len(set(listed)) == len(TYPE_IDS)  # no type in two directions
    assert set(listed) == set(TYPE_IDS)
    for i, a in enumerate(directions):
        for b in directions[i + 1:]:
            assert not set(a) & set(b)
    assert {type(m) for m in WORKER_MSGS} == set(WORKER_TO_GATEWAY)
    assert {type(m) for m in GATEWAY_MSGS} == set(GATEWAY_TO_WORKER)
    assert {type(m) for m in KV_MSGS} == set(PREFILL_TO_DECODE)
    # the channels accept exactly their direction
    for make, types, _ in CHANNELS.values():
        assert set(make()._decoders) == {TYPE_IDS[t] for t in types}


def test_new_type_bytes_are_pinned():
    # type bytes are the wire format: a renumbering breaks mixed-version deployments
    assert {t.__name__: TYPE_IDS[t] for t in TYPE_IDS} == {
        "Hello": 1, "Heartbeat": 2, "StepOutputs": 3, "RequestFailed": 4, "Goodbye": 5,
        "Reserved": 6, "ReservationExpired": 7, "KVTransferDone": 8,
        "HelloAck": 16, "AddRequest": 17, "AbortRequests": 18, "Shutdown": 19,
        "ReserveRequest": 20, "PrefillRequest": 21,
        "KVLayer": 32, "KVCommit": 33,
    }
    assert not set(UNUSED_BYTES) & set(TYPE_IDS.values())


def test_tags_are_unique():
    tags = [t.__struct_config__.tag for t in TYPE_IDS]
    assert all(isinstance(tag, str) for tag in tags)
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("msg", ALL_MSGS, ids=_id)
def test_samples_set_every_optional_field(msg):
    # a round trip only proves a field is carried if the sample differs from its default
    for f, default in zip(msg.__struct_fields__[-len(msg.__struct_defaults__):],
                          msg.__struct_defaults__) if msg.__struct_defaults__ else ():
        if type(msg) is KVCommit and msg.request_id == "r5":
            continue  # the deliberate no-logprob sample
        assert getattr(msg, f) != default, f"{type(msg).__name__}.{f} left at its default"
    for f in WorkerStats.__struct_fields__:
        assert getattr(STATS, f) != 0, f


def test_type_ids_unique_and_one_byte():
    ids = list(TYPE_IDS.values())
    assert len(set(ids)) == len(ids)
    assert all(0 <= i <= 255 for i in ids)
    for t, i in TYPE_IDS.items():
        assert bytes([i]) == encode(_example(t))[0]


def _example(t):
    return next(m for m in ALL_MSGS if type(m) is t)


@pytest.mark.parametrize("msg", WORKER_MSGS, ids=_id)
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


@pytest.mark.parametrize("msg", GATEWAY_MSGS, ids=_id)
def test_gateway_to_worker_round_trip(msg):
    ch = worker_channel()
    out = ch.decode(encode(msg))
    assert out is not None
    got, bufs = out
    assert type(got) is type(msg) and got == msg
    assert bufs == []
    assert ch.num_dropped == 0


@pytest.mark.parametrize("msg", KV_MSGS, ids=_id)
def test_prefill_to_decode_round_trip(msg):
    ch = kv_channel()
    frames = encode(msg)
    assert len(frames) == 2 and frames[0] == bytes([TYPE_IDS[type(msg)]])
    out = ch.decode(frames)
    assert out is not None
    got, bufs = out
    assert type(got) is type(msg) and got == msg
    assert bufs == []
    assert ch.num_dropped == 0


def test_kv_layer_block_shape_comes_back_a_tuple():
    got, _ = kv_channel().decode(encode(KV_MSGS[0]))
    assert got.block_shape == (16, 3, 64) and isinstance(got.block_shape, tuple)
    assert got.checksum == 0xDEADBEEF and got.sent_at == 1_700_000_000.25


@pytest.mark.parametrize("name,msg", FOREIGN, ids=lambda x: x if isinstance(x, str) else _id(x))
def test_channels_refuse_other_directions_types(name, msg):
    ch = CHANNELS[name][0]()
    assert ch.decode(encode(msg)) is None
    assert ch.num_dropped == 1
    # and still take their own
    own = CHANNELS[name][2][0]
    assert ch.decode(encode(own)) == (own, [])
    assert ch.num_dropped == 1


def test_every_channel_refuses_every_foreign_type():
    # the parametrized list above really covers each (channel, foreign type) pair
    pairs = {(name, type(m)) for name, m in FOREIGN}
    expected = {(name, t) for name, (_, types, _) in CHANNELS.items()
                for t in TYPE_IDS if t not in types}
    assert pairs == expected
    assert len(expected) == 2 * len(TYPE_IDS)  # each type is foreign to two channels


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


@pytest.mark.parametrize("name,msg", [(n, m) for n, (_, _, msgs) in CHANNELS.items()
                                       for m in msgs],
                         ids=lambda x: x if isinstance(x, str) else _id(x))
def test_valid_body_under_a_foreign_type_byte_is_dropped(name, msg):
    # the type byte alone picks the decoder: an unused byte, or one of another
    # direction's bytes, is dropped even though the body itself is well formed
    make, types, _ = CHANNELS[name]
    body = encode(msg)[1]
    ch = make()
    foreign = [*UNUSED_BYTES, *(i for t, i in TYPE_IDS.items() if t not in types)]
    assert not set(foreign) & {TYPE_IDS[t] for t in types}
    for byte in foreign:
        assert ch.decode([bytes([byte]), body]) is None, byte
    assert ch.num_dropped == len(foreign)
    # a valid byte of the same direction but another type: the body's tag does not match
    for t in types:
        if t is not type(msg):
            assert ch.decode([bytes([TYPE_IDS[t]]), body]) is None, t
    assert ch.num_dropped == len(foreign) + len(types) - 1
    assert ch.decode([bytes([TYPE_IDS[type(msg)]]), body]) == (msg, [])


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


def test_kv_layer_buffers_come_back_unchanged():
    # K then V, as raw frames after the header: never copied, never re-encoded
    k = bytes(range(256)) * 48  # 12288 bytes
    v_arr = bytearray(b"\x7f\x00v-bytes\xff" * 1229)[:12288]
    v = memoryview(v_arr)
    msg = KV_MSGS[0]
    frames = encode(msg, [k, v])
    assert len(frames) == 4
    assert frames[2] is k and frames[3] is v
    ch = kv_channel()
    out = ch.decode(frames)
    assert out is not None
    got, bufs = out
    assert got == msg
    assert len(bufs) == 2
    assert bufs[0] is k and bufs[1] is v
    assert bytes(bufs[1]) == bytes(v_arr) and len(bufs[1]) == msg.nbytes
    assert ch.num_dropped == 0
    # as ZMQ hands them back (zero-copy buffers), order and bytes are kept
    got, bufs = ch.decode([memoryview(f) for f in frames])
    assert got == msg and [bytes(b) for b in bufs] == [k, bytes(v_arr)]
    # a KVLayer on the gateway or worker socket is dropped, buffers and all
    for make in (gateway_channel, worker_channel):
        other = make()
        assert other.decode(frames) is None and other.num_dropped == 1


def test_malformed_kv_frames_are_dropped():
    ch = kv_channel()
    layer = encode(KV_MSGS[0])
    bad = [
        [layer[0], layer[1][:-3]],  # truncated header
        [layer[0], msgspec.msgpack.encode({"type": "kv_layer", "request_id": "r"})],
        [layer[0], msgspec.msgpack.encode(
            {**msgspec.structs.asdict(KV_MSGS[0]), "type": "kv_layer",
             "block_shape": [16, 3]})],  # a 2-tuple where 3 are needed
        [layer[0], encode(KV_MSGS[1])[1]],  # a KVCommit body under KVLayer's byte
        [bytes([TYPE_IDS[KVCommit]]), layer[1]],  # and the reverse
        [layer[0]],
    ]
    for frames in bad:
        assert ch.decode(frames) is None
    assert ch.num_dropped == len(bad)
    assert ch.decode(encode(KV_MSGS[2])) == (KV_MSGS[2], [])


def test_old_peers_without_the_new_fields_decode_with_defaults():
    # a Hello or WorkerStats without the fields added for disaggregation still decodes
    hello = msgspec.msgpack.encode({
        "type": "hello", "worker_id": "w0", "role": "colocated",
        "protocol_version": PROTOCOL_VERSION, "fingerprint": msgspec.structs.asdict(FP),
        "capacity": msgspec.structs.asdict(CAP)})
    got, _ = gateway_channel().decode([bytes([TYPE_IDS[Hello]]), hello])
    assert got.kv_endpoint == "" and got.pid == 0 and got.fingerprint == FP
    hb = msgspec.msgpack.encode({"type": "heartbeat", "worker_id": "w0",
                                 "stats": {"num_running": 1, "num_blocks_total": 9}})
    got, _ = gateway_channel().decode([bytes([TYPE_IDS[Heartbeat]]), hb])
    assert got.stats == WorkerStats(num_running=1, num_blocks_total=9)
    assert (got.stats.num_reserved_blocks, got.stats.prefill_queue_tokens,
            got.stats.kv_bytes_received, got.stats.kv_transfer_failures) == (0, 0, 0, 0)


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
        for msg in [
            AddRequest(request_id="r", prompt_token_ids=[3, 1, 4], params=params),
            ReserveRequest(request_id="r", prompt_token_ids=[3, 1, 4], params=params),
            PrefillRequest(request_id="r", prompt_token_ids=[3, 1, 4], params=params,
                           decode_worker_id="d0", kv_endpoint="ipc:///tmp/kv-d0"),
        ]:
            got, _ = worker_channel().decode(encode(msg))
            assert type(got) is type(msg) and got == msg
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
