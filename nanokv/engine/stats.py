"""KV cache statistics: pool use, internal fragmentation, prefix-cache hits, preemptions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the paged KV pool, taken between steps.

    stored_tokens counts tokens whose K/V sits in used blocks (a block shared by several
    requests counts once); allocated_slots is used_blocks * block_size. Their difference is
    the internal fragmentation: the unfilled tail of each request's last block, so less
    than one block per running request. Prefix-cache counters are in prompt tokens, one
    lookup per admission (a preempted request looks up again when readmitted).
    """

    block_size: int
    num_blocks: int
    used_blocks: int
    free_blocks: int
    free_cached_blocks: int  # free, but still holding reusable prefix content
    peak_used_blocks: int
    stored_tokens: int
    allocated_slots: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    peak_running_seqs: int = 0  # the most sequences holding blocks at once, since the engine started
    # K and V of one cached token over all layers, scales included (this rank's share of the
    # heads under tensor parallelism); 0 when unknown
    bytes_per_token: int = 0
    touched_blocks: int = 0  # blocks handed out at least once since start: ids 0..touched_blocks-1
    # The pool's memory (this rank's, like bytes_per_token): reserved is its whole allocation
    # (every block and the runner's one scratch block); committed what is in memory now. On
    # the CPU the pool commits a block's pages when it is first written, so committed is
    # touched_blocks' bytes; on CUDA the pool is allocated whole, committed = reserved.
    reserved_bytes: int = 0
    committed_bytes: int = 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def fragmentation_tokens(self) -> int:
        return self.allocated_slots - self.stored_tokens

    @property
    def fragmentation(self) -> float:
        return self.fragmentation_tokens / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tokens_per_gib(self) -> int:
        return (1 << 30) // self.bytes_per_token if self.bytes_per_token else 0

    def summary(self) -> str:
        return (f"KV cache: {self.used_blocks}/{self.num_blocks} blocks used ({self.usage:.1%}), "
                f"{self.capacity_tokens} tokens of {self.bytes_per_token} bytes ({self.tokens_per_gib} per GiB), "
                f"peak {self.peak_used_blocks}, {self.free_cached_blocks} free but cached; "
                f"{self.committed_bytes / 2**20:.1f} MiB committed of {self.reserved_bytes / 2**20:.1f} reserved; "
                f"fragmentation {self.fragmentation_tokens} tokens ({self.fragmentation:.1%}); "
                f"prefix cache hit {self.prefix_hit_tokens}/{self.prefix_query_tokens} tokens "
                f"({self.hit_rate:.1%}); preemptions {self.num_preemptions}; peak {self.peak_running_seqs} running")
