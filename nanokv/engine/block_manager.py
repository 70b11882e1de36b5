"""Paged KV memory: ref-counted blocks, a chained-hash prefix cache and an LRU free queue.

A block holds the K/V of `block_size` consecutive tokens of one or more sequences
(several when they share a cached prefix). A full block whose tokens are computed is
registered in the prefix cache under hash(parent block's hash, its token ids); a later
request whose leading blocks hash the same, *and* hold the same tokens, reuses it.

Freed blocks keep their cached content and wait in the free queue, least recently freed
first, until a new allocation evicts them. Blocks with nothing cached are queued at the
front, so they are reused before any cached content is evicted. Blocks never handed out
wait between the two, lowest id first: the blocks ever used are always 0..touched_blocks-1,
so the memory the CPU pool commits as blocks are first written (runner/kv_cache.py) is one
compact range. Every operation costs O(blocks touched), never O(pool size).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence as Seq
from functools import lru_cache

import xxhash

from nanokv.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained hash of one full block: identifies the block *and* everything before it:
    xxh64 of the parent's hash (8 bytes, little-endian) and the token ids (int64 each)."""
    if parent_hash is None:
        return xxhash.xxh64_intdigest(_block_struct(len(token_ids), False).pack(*token_ids))
    return xxhash.xxh64_intdigest(_block_struct(len(token_ids), True).pack(parent_hash, *token_ids))


@lru_cache(maxsize=64)
def _block_struct(num_tokens: int, parent: bool) -> struct.Struct:
    # one struct call packs a block several times faster than array("q", tokens)
    return struct.Struct(f"<{'Q' if parent else ''}{num_tokens}q")


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        self.token_ids: tuple[int, ...] | None = None  # its tokens, to reject hash collisions

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU free queue (an OrderedDict is a doubly linked list: O(1) pop, append, removal).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Prompt blocks that a running sequence will compute but has not yet: hash -> seq id.
        # A request needing the same block waits for it instead of computing it again.
        self.in_flight: dict[int, int] = {}
        self.num_free_cached = 0  # free blocks that still hold cached content
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, tokens found
        self.peak_used_blocks = 0
        # blocks handed out at least once: ids 0..touched_blocks-1 (never-used blocks go out lowest id first)
        self.touched_blocks = 0

    # ---- queries --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Chained hashes of the full blocks among seq's first num_tokens tokens (memoised)."""
        bs, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold seq's leading full blocks (longest run).

        Changes nothing; pass the result to allocate(). A hit needs both the hash and the
        stored tokens to match, so a hash collision is a miss, never wrong output.
        """
        if not self.enable_prefix_caching:
            return []
        bs, tokens, hits = self.block_size, seq.token_ids, []
        for i, h in enumerate(self.block_hashes(seq, seq.num_tokens)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def waits_for_in_flight(self, seq: Sequence, num_hit_blocks: int) -> bool:
        """True when seq's first uncached block is being computed by another sequence:
        admitting seq now would compute the same prefix twice in parallel."""
        if not self.in_flight or num_hit_blocks >= len(seq.block_hashes):
            return False
        owner = self.in_flight.get(seq.block_hashes[num_hit_blocks])
        return owner is not None and owner != seq.seq_id

    def mark_in_flight(self, seq: Sequence) -> None:
        """Announce the full prompt blocks seq (just admitted) is about to compute."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(seq, seq.num_prompt_tokens)
        for h in hashes[seq.num_hashed_blocks:]:  # past the blocks it found cached
            self.in_flight.setdefault(h, seq.seq_id)

    def _clear_in_flight(self, seq: Sequence, start: int, stop: int) -> None:
        for h in seq.block_hashes[start:stop]:
            if self.in_flight.get(h) == seq.seq_id:
                del self.in_flight[h]

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Grow seq's block table to cover its first num_tokens tokens.

        cached_blocks (from find_cached_prefix, for a sequence with an empty table) are
        taken first, shared by reference. Returns False and changes nothing when the
        pool has too few free blocks.
        """
        assert not cached_blocks or not seq.block_table
        table = seq.block_table
        num_new = -(-num_tokens // self.block_size) - len(table) - len(cached_blocks)
        # cached blocks that sit in the free queue are not available for new pages
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_new > len(self.free_queue) - revived:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
                self.num_free_cached -= 1
            block.ref_count += 1
        if cached_blocks:
            table.extend(cached_blocks)
            seq.num_hashed_blocks = len(table)
        for _ in range(num_new):
            table.append(self._take_free_block())
        self.peak_used_blocks = max(self.peak_used_blocks, len(self.blocks) - len(self.free_queue))
        return True

    def append_blocks(self, tables: list[list[int]]) -> bool:
        """One more block at the end of each of these tables (decodes whose new token
        starts a block), in order. Returns False and changes nothing when the pool has too
        few free blocks."""
        if len(tables) > len(self.free_queue):
            return False
        take = self._take_free_block
        for table in tables:
            table.append(take())
        self.peak_used_blocks = max(self.peak_used_blocks, len(self.blocks) - len(self.free_queue))
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        if block_id >= self.touched_blocks:
            self.touched_blocks = block_id + 1
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            self.num_free_cached -= 1
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release seq's pages. Tail blocks are queued before head blocks, so a shared
        prefix outlives the suffixes that hang off it."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"double free of block {block_id}"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is not None:
                    self.num_free_cached += 1
                else:  # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block_id, last=False)
        if self.in_flight:
            self._clear_in_flight(seq, seq.num_hashed_blocks, len(seq.block_hashes))
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    # ---- prefix cache ---------------------------------------------------------------
    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly completed blocks (all tokens computed) in the prefix cache.
        The common case, a decode that filled one more block, takes no loop."""
        if not self.enable_prefix_caching:
            return
        bs, first, hashes = self.block_size, seq.num_hashed_blocks, seq.block_hashes
        num_full = seq.num_computed_tokens // bs
        if num_full <= first:
            return
        if num_full == first + 1 and len(hashes) >= first:  # one block: its hash at most one call away
            if len(hashes) == first:
                hashes.append(hash_block(hashes[-1] if first else None, seq.token_ids[first * bs:num_full * bs]))
            self._register(seq, first)
        else:
            self.block_hashes(seq, num_full * bs)
            for i in range(first, num_full):
                self._register(seq, i)
        if self.in_flight:
            self._clear_in_flight(seq, first, num_full)
        seq.num_hashed_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache: after new weights, say).
        Only when no sequence holds a block, as in vLLM: returns False and changes nothing
        otherwise. The lookup counters go on counting."""
        if self.num_used_blocks:
            return False
        for block_id in self.cached.values():
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self.num_free_cached = 0
        return True

    def _register(self, seq: Sequence, i: int) -> None:
        """Block i of seq (full, its hash known) into the prefix cache, unless it is there."""
        h, bs = seq.block_hashes[i], self.block_size
        block = self.blocks[seq.block_table[i]]
        if block.block_hash is None and h not in self.cached:
            block.block_hash = h
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.cached[h] = block.block_id
