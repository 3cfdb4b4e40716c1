"""KV transfer between workers over ZeroMQ: a prefill worker pushes a request's KV, layer by
layer, straight to the decode worker that reserved room for it.

Wire shape (scheduler/protocol.py): per layer a `KVLayer` header (request, layer, token and
block counts, dtype, block shape, byte size, crc32) followed by two raw frames, K then V, each
the request's whole blocks [num_blocks, block_size, kv_heads, head_dim], sent without copies
by ZeroMQ's I/O thread while the next layer computes; then a `KVCommit` with the first token.
The receiver writes nothing unless the request holds a reservation and every field checks
out; a reservation that is not committed in time expires and its blocks go back to the pool.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from cache.block_pool import BlockManager
from cache.kv_storage import TORCH_DTYPES, KVCacheStorage
from scheduler.protocol import KVCommit, KVLayer, LogprobEntry, encode
from scheduler.sampling_params import SamplingParams

log = logging.getLogger("splitserve.transfer")

SEND_TIMEOUT_MS = 10_000
SEND_HWM = 4096  # messages queued per decode endpoint before sends block (then time out)


def _crc(k: memoryview, v: memoryview) -> int:
    return zlib.crc32(v, zlib.crc32(k))


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class KVSender:
    """Prefill side: one PUSH socket per decode endpoint, bounded queue and send timeout."""

    def __init__(self, ctx: zmq.Context, storage: KVCacheStorage) -> None:
        self.ctx = ctx
        self.storage = storage
        self._socks: dict[str, zmq.Socket] = {}
        self.bytes_sent = 0
        self.failures = 0

    def _sock(self, endpoint: str) -> zmq.Socket:
        s = self._socks.get(endpoint)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.setsockopt(zmq.SNDHWM, SEND_HWM)
            s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            s.connect(endpoint)
            self._socks[endpoint] = s
        return s

    def send_layer(self, endpoint: str, request_id: str, layer: int, blocks: list[int],
                   num_tokens: int) -> bool:
        lay = self.storage.layout
        nb = lay.blocks_for_tokens(num_tokens)
        ids = torch.tensor(blocks[:nb], dtype=torch.long, device=self.storage.device)
        kv = self.storage.tensor[layer]
        k = _bytes_of(kv[0].index_select(0, ids))  # a copy: the blocks may be reused at once
        v = _bytes_of(kv[1].index_select(0, ids))
        header = KVLayer(request_id=request_id, layer=layer, num_tokens=num_tokens,
                         num_blocks=nb, dtype=lay.dtype,
                         block_shape=lay.block_shape,
                         nbytes=len(k), checksum=_crc(k, v), sent_at=time.time())
        try:
            self._sock(endpoint).send_multipart(encode(header, [k, v]), copy=False)
        except zmq.ZMQError as e:
            self.failures += 1
            log.error("KV send of %s layer %d to %s failed: %s", request_id, layer, endpoint, e)
            return False
        self.bytes_sent += 2 * len(k)
        return True

    def commit(self, endpoint: str, request_id: str, first_token: int,
               first_logprob: LogprobEntry | None, compute_done_at: float = 0.0) -> bool:
        msg = KVCommit(request_id, self.storage.layout.num_layers, first_token, first_logprob,
                       compute_done_at)
        try:
            self._sock(endpoint).send_multipart(encode(msg))
            return True
        except zmq.ZMQError as e:
            self.failures += 1
            log.error("KV commit of %s to %s failed: %s", request_id, endpoint, e)
            return False

    def close(self) -> None:
        for s in self._socks.values():
            s.close()


@dataclass
class Reservation:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_blocks: int = 0
    deadline: float = 0.0
    layers: set[int] = field(default_factory=set)
    first_sent_at: float | None = None
    num_bytes: int = 0


class KVReceiver:
    """Decode side: reservations (queued until blocks are free), validation, writes, expiry."""

    def __init__(self, blocks: BlockManager, storage: KVCacheStorage,
                 timeout_s: float = 30.0) -> None:
        self.blocks = blocks
        self.storage = storage
        self.timeout_s = timeout_s
        self.pending: deque[Reservation] = deque()  # waiting for free blocks
        self.active: dict[str, Reservation] = {}  # blocks held, KV arriving
        self.bytes_received = 0
        self.failures = 0

    @property
    def num_reserved_blocks(self) -> int:
        return sum(r.num_blocks for r in self.active.values())

    def request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.pending.append(Reservation(request_id, list(prompt), params))

    def admit_pending(self, now: float | None = None) -> list[Reservation]:
        """Reserve blocks for queued requests, in order, while they fit: prompt + 1 token."""
        now = time.monotonic() if now is None else now
        done = []
        while self.pending:
            r = self.pending[0]
            need = len(r.prompt_token_ids) + 1
            if not self.blocks.can_grow(r.request_id, need):
                break
            self.pending.popleft()
            r.num_blocks = len(self.blocks.grow(r.request_id, need))
            r.deadline = now + self.timeout_s
            self.active[r.request_id] = r
            done.append(r)
        return done

    def cancel(self, request_id: str) -> bool:
        """Drop a reservation (client gone, prefill failed): its blocks are freed."""
        for r in list(self.pending):
            if r.request_id == request_id:
                self.pending.remove(r)
                return True
        r = self.active.pop(request_id, None)
        if r is None:
            return False
        self.blocks.free(request_id)
        return True

    def expire(self, now: float | None = None) -> list[Reservation]:
        now = time.monotonic() if now is None else now
        gone = [r for r in self.active.values() if now > r.deadline]
        for r in gone:
            self.cancel(r.request_id)
            self.failures += 1
        return gone

    def _reject(self, msg: KVLayer, why: str) -> str:
        self.failures += 1
        log.warning("rejected KV layer %d of %s: %s", msg.layer, msg.request_id, why)
        return why

    def on_layer(self, msg: KVLayer, frames: list) -> str | None:
        """Validate and write one layer; returns why it was rejected, or None."""
        r = self.active.get(msg.request_id)
        lay = self.storage.layout
        if r is None:
            return self._reject(msg, "no reservation (expired, aborted or never made)")
        if msg.num_tokens != len(r.prompt_token_ids):
            return self._reject(msg, f"{msg.num_tokens} tokens, reserved for "
                                f"{len(r.prompt_token_ids)}")
        if msg.num_blocks != lay.blocks_for_tokens(msg.num_tokens) or msg.num_blocks > r.num_blocks:
            return self._reject(msg, f"bad block count {msg.num_blocks}")
        if msg.dtype != lay.dtype or tuple(msg.block_shape) != lay.block_shape:
            return self._reject(msg, f"layout {msg.dtype} {msg.block_shape} does not match")
        if not 0 <= msg.layer < lay.num_layers or msg.layer in r.layers:
            return self._reject(msg, f"bad or repeated layer {msg.layer}")
        expected = msg.num_blocks * lay.bytes_per_block // (2 * lay.num_layers)
        if len(frames) != 2 or msg.nbytes != expected or any(
                len(memoryview(f)) != expected for f in frames):
            return self._reject(msg, "frame sizes do not match the header")
        k, v = (memoryview(f).cast("B") for f in frames)
        if _crc(k, v) != msg.checksum:
            return self._reject(msg, "checksum mismatch")
        ids = torch.tensor(self.blocks.table(r.request_id)[:msg.num_blocks], dtype=torch.long,
                           device=self.storage.device)
        shape = (msg.num_blocks, *lay.block_shape)
        dt = TORCH_DTYPES[lay.dtype]
        for i, buf in enumerate((k, v)):
            t = torch.frombuffer(buf, dtype=torch.uint8).view(dt).view(shape)
            self.storage.tensor[msg.layer, i].index_copy_(0, ids, t.to(self.storage.device))
        r.layers.add(msg.layer)
        r.num_bytes += 2 * msg.nbytes
        self.bytes_received += 2 * msg.nbytes
        if r.first_sent_at is None or msg.sent_at < r.first_sent_at:
            r.first_sent_at = msg.sent_at
        return None

    def on_commit(self, msg: KVCommit) -> tuple[Reservation | None, str | None]:
        """(the completed reservation, None) or (None, why not)."""
        r = self.active.get(msg.request_id)
        if r is None:
            self.failures += 1
            return None, "commit without a reservation"
        if len(r.layers) != msg.num_layers or msg.num_layers != self.storage.layout.num_layers:
            self.cancel(msg.request_id)
            self.failures += 1
            return None, f"commit after {len(r.layers)} of {msg.num_layers} layers"
        del self.active[msg.request_id]  # the blocks now belong to the decoding sequence
        return r, None

