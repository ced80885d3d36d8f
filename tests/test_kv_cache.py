"""Block pool and KV cache manager: O(1) alloc/free, null block, on-demand growth."""

import pytest

from llmserve.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager


def test_free_queue_order_and_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 0]
    for _ in range(4):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_block_pool_never_hands_out_null_block():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in got) == [1, 2, 3]
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(got[:1])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.free_blocks(b)
    pool.free_blocks(a)
    assert [x.block_id for x in pool.get_new_blocks(4)] == [b[0].block_id, b[1].block_id,
                                                            a[0].block_id, a[1].block_id]


def test_manager_allocates_on_demand_and_frees():
    m = KVCacheManager(num_blocks=9, block_size=4)  # 8 usable
    assert m.allocate_slots("a", 0, 1) == []
    assert len(m.get_block_ids("a")) == 1
    assert m.allocate_slots("a", 1, 3) == []  # still one block
    assert len(m.get_block_ids("a")) == 1
    assert m.allocate_slots("a", 4, 1) == []
    assert len(m.get_block_ids("a")) == 2
    assert m.allocate_slots("b", 0, 24) == []  # 6 blocks
    assert m.get_num_free_blocks() == 0
    assert m.allocate_slots("c", 0, 1) is None
    assert "c" not in m.req_to_blocks  # a failed allocation leaves nothing behind
    assert m.allocate_slots("a", 5, 4) is None
    assert len(m.get_block_ids("a")) == 2
    assert 0 not in m.get_block_ids("a") + m.get_block_ids("b")
    m.free("a")
    m.free("b")
    m.free("unknown")
    assert m.get_num_free_blocks() == 8
    assert m.usage == 0.0
