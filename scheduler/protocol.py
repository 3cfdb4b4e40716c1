"""The wire protocol: every message that crosses a process, as msgspec structs.

A message on a ZMQ socket is multipart: one type byte, the msgpack body, then zero or more
raw buffer frames (tensor bytes, for KV transfer). Each socket decodes with a `Channel` that
accepts only the types meant for it; an unknown type byte or a malformed body is dropped and
counted, never executed. No pickle anywhere.
"""

from __future__ import annotations

import logging

import msgspec

from scheduler.sampling_params import SamplingParams

log = logging.getLogger("splitserve.protocol")

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 2**20  # ZMQ_MAXMSGSIZE on every socket


class ModelFingerprint(msgspec.Struct, frozen=True):
    """What must agree between workers that share KV (and with the gateway's tokenizer)."""

    model: str
    dtype: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


class WorkerCapacity(msgspec.Struct, frozen=True):
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int
    max_num_seqs: int


class WorkerStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative
    num_reserved_blocks: int = 0  # decode role: held for KV that has not arrived yet
    prefill_queue_tokens: int = 0  # prompt tokens waiting or running on this worker
    kv_bytes_received: int = 0  # cumulative (decode role)
    kv_transfer_failures: int = 0  # cumulative: rejected frames, expired reservations


class LogprobEntry(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class TokenDelta(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[LogprobEntry] | None = None
    queue_s: float | None = None  # on the first token: waiting on the worker
    prefill_s: float | None = None  # on the first token: first scheduled -> first token


# ---- worker -> gateway ----
class Hello(msgspec.Struct, tag="hello"):
    worker_id: str
    role: str  # colocated | prefill | decode
    protocol_version: int
    fingerprint: ModelFingerprint
    capacity: WorkerCapacity
    pid: int = 0
    kv_endpoint: str = ""  # decode role: where prefill workers push KV


class Reserved(msgspec.Struct, tag="reserved"):
    """Decode worker -> gateway: room for the request's KV is held until `expires_in_s`."""

    request_id: str
    num_blocks: int
    expires_in_s: float


class ReservationExpired(msgspec.Struct, tag="expired"):
    """Decode worker -> gateway: the KV never (fully) arrived; the blocks are free again."""

    request_id: str
    reason: str


class KVTransferDone(msgspec.Struct, tag="kv_done"):
    """Decode worker -> gateway: a request's KV arrived and it joined the decode batch."""

    request_id: str
    num_bytes: int
    seconds: float  # first layer sent (prefill clock) -> commit received (decode clock)
    exposed_seconds: float = 0.0  # the part after the prefill's forward ended (not overlapped)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    worker_id: str
    stats: WorkerStats


class StepOutputs(msgspec.Struct, tag="outputs"):
    worker_id: str
    deltas: list[TokenDelta]
    stats: WorkerStats


class RequestFailed(msgspec.Struct, tag="failed"):
    request_id: str
    message: str
    status: int = 500


class Goodbye(msgspec.Struct, tag="goodbye"):
    worker_id: str
    reason: str = ""


# ---- gateway -> worker ----
class HelloAck(msgspec.Struct, tag="hello_ack"):
    accepted: bool
    reason: str = ""


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class ReserveRequest(msgspec.Struct, tag="reserve"):
    """Gateway -> decode worker: hold blocks for this prompt's KV, then wait for it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class PrefillRequest(msgspec.Struct, tag="prefill"):
    """Gateway -> prefill worker: prefill, sample the first token, push the KV to a decode
    worker that has reserved room for it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_worker_id: str
    kv_endpoint: str


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = ""


# ---- prefill worker -> decode worker (the KV channel) ----
class KVLayer(msgspec.Struct, tag="kv_layer"):
    """One layer of a request's KV: followed by two buffer frames, K then V, each
    [num_blocks, block_size, kv_heads, head_dim] in `dtype` (whole blocks)."""

    request_id: str
    layer: int
    num_tokens: int
    num_blocks: int
    dtype: str
    block_shape: tuple[int, int, int]  # block_size, kv_heads, head_dim
    nbytes: int  # of each of K and V
    checksum: int  # crc32 of K then V
    sent_at: float  # time.time() on the sender when this layer was sent


class KVCommit(msgspec.Struct, tag="kv_commit"):
    """Every layer has been sent; the request continues from `first_token` on the decode
    worker."""

    request_id: str
    num_layers: int
    first_token: int
    first_logprob: LogprobEntry | None = None
    compute_done_at: float = 0.0  # time.time() on the prefill worker when its forward ended


# One type byte per message type; never reuse a number.
TYPE_IDS: dict[type, int] = {
    Hello: 1, Heartbeat: 2, StepOutputs: 3, RequestFailed: 4, Goodbye: 5,
    Reserved: 6, ReservationExpired: 7, KVTransferDone: 8,
    HelloAck: 16, AddRequest: 17, AbortRequests: 18, Shutdown: 19, ReserveRequest: 20,
    PrefillRequest: 21,
    KVLayer: 32, KVCommit: 33,
}
WORKER_TO_GATEWAY = (Hello, Heartbeat, StepOutputs, RequestFailed, Goodbye, Reserved,
                     ReservationExpired, KVTransferDone)
GATEWAY_TO_WORKER = (HelloAck, AddRequest, AbortRequests, Shutdown, ReserveRequest,
                     PrefillRequest)
PREFILL_TO_DECODE = (KVLayer, KVCommit)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct, buffers: list | None = None) -> list:
    """Frames for one message: [type byte, msgpack body, *raw buffers]."""
    return [bytes([TYPE_IDS[type(msg)]]), _encoder.encode(msg), *(buffers or [])]


class Channel:
    """Typed decoder for one socket direction; counts what it drops."""

    def __init__(self, name: str, types: tuple[type, ...]) -> None:
        self.name = name
        self._decoders = {TYPE_IDS[t]: msgspec.msgpack.Decoder(t) for t in types}
        self.num_dropped = 0

    def decode(self, frames: list) -> tuple[msgspec.Struct, list] | None:
        """(message, buffer frames), or None when the frames are not a valid message."""
        try:
            if len(frames) < 2 or len(frames[0]) != 1:
                raise ValueError(f"bad framing ({len(frames)} frames)")
            dec = self._decoders.get(bytes(frames[0])[0])
            if dec is None:
                raise ValueError(f"unknown type byte {bytes(frames[0])[0]}")
            return dec.decode(frames[1]), list(frames[2:])
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_dropped += 1
            log.warning("%s: dropped a malformed message: %s", self.name, e)
            return None


def worker_channel() -> Channel:
    """What a worker accepts from the gateway."""
    return Channel("worker<-gateway", GATEWAY_TO_WORKER)


def gateway_channel() -> Channel:
    """What the gateway accepts from workers."""
    return Channel("gateway<-worker", WORKER_TO_GATEWAY)


def kv_channel() -> Channel:
    """What a decode worker accepts on its KV endpoint."""
    return Channel("decode<-prefill", PREFILL_TO_DECODE)
