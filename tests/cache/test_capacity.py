import pytest

from cache.block_pool import BlockManager, BlockPool, NoFreeBlocksError
from cache.kv_storage import KVCacheStorage
from cache.layout import KVLayout, format_bytes, parse_bytes


def test_smollm2_bf16_bytes_per_token():
    # 2 x 30 layers x 3 KV heads x 64 head dim x 2 bytes
    assert KVLayout(30, 3, 64, "bfloat16").bytes_per_token == 23_040
    assert KVLayout(30, 3, 64, "float32").bytes_per_token == 46_080


@pytest.mark.parametrize("layers,kvh,hd,dtype,bs", [
    (30, 3, 64, "bfloat16", 16), (2, 1, 8, "float32", 4), (5, 7, 24, "float16", 32),
    (32, 8, 128, "bfloat16", 16), (3, 2, 16, "float32", 1),
])
def test_storage_bytes_equal_formula(layers, kvh, hd, dtype, bs):
    layout = KVLayout(layers, kvh, hd, dtype, bs)
    budget = 3 * layout.bytes_per_block + 17  # a budget that is not a whole number of blocks
    n = layout.num_blocks_for_budget(budget)
    assert n == 3
    st = KVCacheStorage(layout, n, "cpu")
    expected = n * bs * 2 * layers * kvh * hd * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    assert st.nbytes == layout.pool_bytes(n) == expected
    k, v = st.layer(layers - 1)
    assert k.shape == (n * bs, kvh, hd) and v.shape == (n * bs, kvh, hd)
    assert k.data_ptr() != v.data_ptr()


def test_parse_and_format_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("4096") == 4096
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    for bad in ("", "12 parsecs", "-1MiB", "MiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_budget_smaller_than_a_block_is_an_error():
    with pytest.raises(ValueError, match="smaller than one block"):
        KVLayout(30, 3, 64, "bfloat16").num_blocks_for_budget(1000)


def test_pool_refcounts_and_free_list():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.usage == 0.75
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)


def test_block_manager_grows_tables_by_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.blocks_needed("s", 9) == 3
    t = bm.grow("s", 9)
    assert len(t) == 3 and bm.num_free_blocks == 7
    assert bm.blocks_needed("s", 12) == 0 and bm.blocks_needed("s", 13) == 1
    bm.grow("s", 13)
    assert len(bm.table("s")) == 4
    assert not bm.can_grow("x", 4 * 7)
    bm.free("s")
    assert bm.num_used_blocks == 0
    bm.free("s")  # freeing an unknown sequence is a no-op
