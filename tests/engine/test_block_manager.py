"""Block manager: exact block ids for allocation, sharing, freeing, hits, collisions, LRU."""

import pytest

from nanokv.engine import block_manager as bm_module
from nanokv.engine.block_manager import BlockManager, hash_block
from nanokv.engine.sequence import Sequence
from nanokv.sampling_params import SamplingParams


def make_seq(tokens, max_tokens=8):
    return Sequence("r", list(tokens), SamplingParams(temperature=0), max_tokens)


def computed(bm, seq, num_tokens):
    """Pretend the model computed seq's first num_tokens tokens (as the scheduler records)."""
    seq.num_computed_tokens = num_tokens
    bm.cache_full_blocks(seq)


def admit(bm, seq):
    """Admission as the scheduler does it: cached prefix first, then fresh blocks."""
    hits = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens, hits)
    return hits


def test_allocate_takes_blocks_in_order_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(range(10)), make_seq(range(100, 105))
    assert bm.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.allocate(b, 5)
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    # growing by one token inside the last block needs no block; crossing a boundary does
    assert bm.allocate(a, 12) and a.block_table == [0, 1, 2]
    assert bm.allocate(a, 13) and a.block_table == [0, 1, 2, 5]
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 6
    assert [bm.blocks[i].ref_count for i in range(8)] == [0, 0, 0, 1, 1, 0, 0, 0]


def test_allocate_fails_without_changing_anything():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(range(12)), make_seq(range(8))
    assert bm.allocate(a, 12)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1


def test_shared_prefix_hits_same_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)) + [50, 51])
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    computed(bm, a, 10)  # blocks 0 and 1 are full -> cached; block 2 is partial -> not
    assert bm.blocks[0].block_hash == hash_block(None, range(4))
    assert bm.blocks[1].block_hash == hash_block(bm.blocks[0].block_hash, range(4, 8))
    assert bm.blocks[2].block_hash is None

    b = make_seq(list(range(8)) + [60, 61, 62])
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    bm.free(b)
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert bm.num_free_blocks == 8


def test_miss_on_different_tokens_and_partial_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(12))
    admit(bm, a)
    computed(bm, a, 12)
    assert bm.find_cached_prefix(make_seq([9, 9, 9, 9] + list(range(4, 12)))) == []
    # first block equal, second differs: the chain stops at the first miss
    assert bm.find_cached_prefix(make_seq(list(range(4)) + [7, 7, 7, 7] + list(range(8, 12)))) == [0]
    # same tokens at the same place but a different parent -> different hash -> miss
    assert bm.find_cached_prefix(make_seq(list(range(4, 8)))) == []


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])
    admit(bm, a)
    computed(bm, a, 3)
    assert bm.cached == {42: 0}
    b = make_seq([5, 6, 7])  # same (fake) hash, different tokens
    assert bm.find_cached_prefix(b) == []
    assert bm.find_cached_prefix(make_seq([1, 2, 9])) == [0]


def test_freed_blocks_keep_content_and_revive_on_hit():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    computed(bm, a, 5)
    bm.free(a)
    assert bm.num_free_cached == 2 and bm.num_free_blocks == 4
    b = make_seq([1, 2, 3, 4, 9])
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 1 and bm.num_free_cached == 0


def test_lru_eviction_order():
    """Uncached free blocks go first; then cached ones, least recently freed first, and
    within one sequence its tail before its head. An evicted block loses its hash."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq([1, 2, 3, 4]), make_seq([5, 6, 7, 8])
    admit(bm, a)  # blocks 0, 1
    admit(bm, b)  # blocks 2, 3
    computed(bm, a, 4)
    computed(bm, b, 4)
    bm.free(a)  # queue: 4 5 | 1 0
    bm.free(b)  # queue: 4 5 | 1 0 3 2
    assert list(bm.free_queue) == [4, 5, 1, 0, 3, 2]
    c = make_seq(range(100, 108))
    assert bm.allocate(c, 8)
    assert c.block_table == [4, 5, 1, 0]
    # blocks 1 and 0 were evicted: a's prefix no longer hits, b's still does
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4])) == []
    assert bm.find_cached_prefix(make_seq([5, 6, 7, 8])) == [2, 3]
    assert set(bm.cached.values()) == {2, 3}
    assert bm.blocks[0].block_hash is None and bm.blocks[1].block_hash is None


def test_uncached_freed_block_is_reused_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])  # block 0 full (cached), block 1 partial (not cached)
    admit(bm, a)
    computed(bm, a, 3)
    bm.free(a)
    assert list(bm.free_queue) == [1, 2, 3, 0]


def test_no_prefix_caching_computes_no_hashes():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4])
    admit(bm, a)
    computed(bm, a, 4)
    assert bm.cached == {} and a.block_hashes == []
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4])) == []


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_seq([1, 2])
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table.extend(table)
    with pytest.raises(AssertionError):
        bm.free(a)


def test_reset_prefix_cache_forgets_every_cached_block_only_when_none_is_used():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(10))
    admit(bm, a)
    computed(bm, a, 10)  # blocks 0 and 1 cached
    assert sorted(bm.cached.values()) == [0, 1]
    # a sequence holds blocks: refused, nothing changes (vLLM returns False too)
    assert not bm.reset_prefix_cache()
    assert sorted(bm.cached.values()) == [0, 1] and bm.blocks[0].block_hash is not None
    bm.free(a)
    assert bm.num_free_cached == 2 and bm.find_cached_prefix(make_seq(range(10))) == [0, 1]
    assert bm.reset_prefix_cache()
    assert bm.cached == {} and bm.num_free_cached == 0 and bm.num_free_blocks == 8
    assert all(b.block_hash is None and b.token_ids is None for b in bm.blocks)
    # the same prompt now misses and computes its blocks again
    b = make_seq(range(10))
    assert admit(bm, b) == []
    assert b.block_table == [2, 3, 4]  # the free queue's order: a's tail block first, then the unused
    computed(bm, b, 10)
    assert sorted(bm.cached.values()) == [2, 3]
    bm.free(b)
    assert bm.num_free_cached == 2


def test_never_used_blocks_go_out_lowest_id_first():
    """touched_blocks counts the blocks ever handed out, which are always ids 0..n-1: freed
    blocks (cached or not) are reused or wait at the back, never-used ones go in id order,
    so the pages a CPU pool commits stay one compact range."""
    bm = BlockManager(num_blocks=10, block_size=2)
    assert bm.touched_blocks == 0
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([6, 7, 8, 9])
    admit(bm, a)  # 0, 1, 2
    admit(bm, b)  # 3, 4
    assert bm.touched_blocks == 5
    computed(bm, a, 5)
    bm.free(a)  # 2 (partial: not cached) to the front, 1 and 0 (cached) to the back
    c = make_seq([10, 11, 12, 13, 14, 15])
    admit(bm, c)
    assert c.block_table == [2, 5, 6] and bm.touched_blocks == 7
    bm.free(b)
    bm.free(c)
    d = make_seq(range(100, 120))  # every block: freed uncached, never used in id order, then cached
    admit(bm, d)
    assert d.block_table == [2, 5, 6, 3, 4, 7, 8, 9, 1, 0] and bm.touched_blocks == 10


def test_touched_blocks_is_the_count_of_blocks_ever_handed_out():
    """Random admissions, growth and frees with prefix hits: the ids ever handed out are
    exactly 0..touched_blocks-1."""
    import random

    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    live, seen, revived = [], set(), 0
    for _ in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 8):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        # few distinct token runs, so prefixes hit and cached blocks are revived
        seq = make_seq([rng.randrange(3) for _ in range(rng.randrange(1, 20))])
        hits = bm.find_cached_prefix(seq)
        revived += any(bm.blocks[b].ref_count == 0 for b in hits)
        if bm.allocate(seq, seq.num_tokens, hits):
            computed(bm, seq, seq.num_tokens)
            live.append(seq)
            seen.update(seq.block_table)
        assert seen == set(range(bm.touched_blocks))
    assert revived and bm.touched_blocks == 64  # cached blocks were revived; the pool filled in the end
