"""KV transfer over real ZMQ sockets between two KV pools: exact bytes, validation, expiry."""

import time

import pytest
import torch
import zmq

from cache.block_pool import BlockManager
from cache.kv_storage import KVCacheStorage
from cache.layout import KVLayout
from cache.transfer import KVReceiver, KVSender
from scheduler.protocol import KVCommit, KVLayer, encode, kv_channel
from scheduler.sampling_params import SamplingParams

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


@pytest.fixture
def link():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    endpoint = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    src_store = KVCacheStorage(LAYOUT, 16, "cpu")
    dst_store = KVCacheStorage(LAYOUT, 16, "cpu")
    src_blocks, dst_blocks = BlockManager(16, 4), BlockManager(16, 4)
    sender = KVSender(ctx, src_store)
    receiver = KVReceiver(dst_blocks, dst_store, timeout_s=5.0)
    chan = kv_channel()

    def recv():
        assert pull.poll(5000), "nothing arrived"
        got = chan.decode(pull.recv_multipart(copy=False))
        assert got is not None
        return got

    yield dict(endpoint=endpoint, src=src_store, dst=dst_store, src_blocks=src_blocks,
               dst_blocks=dst_blocks, sender=sender, receiver=receiver, recv=recv, pull=pull)
    sender.close()
    pull.close()
    ctx.term()


def fill_prompt(link, rid, n_tokens):
    """Put random KV for n_tokens into the source pool; returns the source block table."""
    table = link["src_blocks"].grow(rid, n_tokens)
    torch.manual_seed(0)
    for layer in range(LAYOUT.num_layers):
        for kv in range(2):
            link["src"].tensor[layer, kv, table] = torch.randn(len(table), 4, 2, 8)
    return table


def test_layers_arrive_byte_exact(link):
    n = 10  # 3 blocks, the last one partly used
    src_table = fill_prompt(link, "r", n)
    rec = link["receiver"]
    rec.request("r", list(range(n)), SamplingParams())
    assert [r.request_id for r in rec.admit_pending()] == ["r"]
    dst_table = link["dst_blocks"].table("r")
    for layer in range(LAYOUT.num_layers):
        assert link["sender"].send_layer(link["endpoint"], "r", layer, src_table, n)
    assert link["sender"].commit(link["endpoint"], "r", 42, None)
    total = 0
    for _ in range(LAYOUT.num_layers):
        msg, frames = link["recv"]()
        assert isinstance(msg, KVLayer) and rec.on_layer(msg, frames) is None
        total += sum(len(memoryview(f)) for f in frames)
    commit, _ = link["recv"]()
    res, why = rec.on_commit(commit)
    assert why is None and res.request_id == "r" and commit.first_token == 42
    # exact bytes: whole blocks, K and V, every layer
    assert total == res.num_bytes == 3 * LAYOUT.bytes_per_block == link["sender"].bytes_sent
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(link["dst"].tensor[layer][:, dst_table],
                           link["src"].tensor[layer][:, src_table])
    assert "r" not in rec.active  # the blocks now belong to the decoding sequence
    assert link["dst_blocks"].num_blocks_held("r") == 3


def test_no_reservation_no_write_and_corruption_rejected(link):
    src_table = fill_prompt(link, "r", 8)
    rec = link["receiver"]
    before = link["dst"].tensor.clone()
    link["sender"].send_layer(link["endpoint"], "r", 0, src_table, 8)
    msg, frames = link["recv"]()
    assert "no reservation" in rec.on_layer(msg, frames)
    assert torch.equal(before, link["dst"].tensor) and rec.failures == 1

    rec.request("r", list(range(8)), SamplingParams())
    rec.admit_pending()
    bad = bytearray(memoryview(frames[0]).tobytes())
    bad[5] ^= 0xFF
    assert "checksum" in rec.on_layer(msg, [bad, frames[1]])
    import msgspec
    for field, value, why in [("num_tokens", 9, "tokens"), ("dtype", "bfloat16", "layout"),
                              ("layer", 7, "layer"), ("nbytes", 3, "frame sizes")]:
        wrong = msgspec.structs.replace(msg, **{field: value})
        assert why in rec.on_layer(wrong, frames)
    assert torch.equal(before, link["dst"].tensor)
    assert rec.on_layer(msg, frames) is None
    assert "repeated" in rec.on_layer(msg, frames)
    res, why = rec.on_commit(KVCommit("r", LAYOUT.num_layers, 1))
    assert res is None and "1 of 3 layers" in why
    assert link["dst_blocks"].num_used_blocks == 0  # the failed reservation was released


def test_reservations_queue_for_room_and_expire(link):
    rec = link["receiver"]
    rec.request("big", list(range(40)), SamplingParams())  # 41 tokens: 11 of the 16 blocks of 4
    rec.request("next", list(range(30)), SamplingParams())  # 8 more: does not fit yet
    now = time.monotonic()
    assert [r.request_id for r in rec.admit_pending(now)] == ["big"]
    assert rec.num_reserved_blocks == 11 and len(rec.pending) == 1
    assert rec.expire(now + 1) == []
    assert [r.request_id for r in rec.expire(now + 6)] == ["big"]
    assert link["dst_blocks"].num_used_blocks == 0 and rec.failures == 1
    assert [r.request_id for r in rec.admit_pending(now + 6)] == ["next"]
    assert rec.cancel("next") and not rec.cancel("next")
    assert link["dst_blocks"].num_used_blocks == 0


def test_malformed_kv_messages_are_dropped():
    chan = kv_channel()
    assert chan.decode([b"\x20", b"garbage"]) is None
    assert chan.decode(encode(KVCommit("r", 3, 1))[:1]) is None
    assert chan.num_dropped == 2
