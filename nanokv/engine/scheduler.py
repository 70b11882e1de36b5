"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step packs, under max_num_batched_tokens and max_num_seqs:
  1. running sequences, oldest first: one token for a decode, the rest of the prompt
     (or as much as the budget allows) for a prefill in progress;
  2. waiting sequences, first come first served, starting after their cached prefix,
     as long as the budget, the sequence limit and free blocks allow.
A running sequence that cannot get a block preempts the newest running sequence
(recompute: its blocks are freed and it goes back to the front of the queue), itself
if it is the newest. No new sequence is admitted in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from nanokv.engine.block_manager import BlockManager
from nanokv.engine.sequence import Sequence, SequenceStatus
from nanokv.engine.stats import KVStats
from nanokv.engine.types import ScheduledBatch, ScheduledSeq, StepOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: Iterable[int] = ()):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.peak_running = 0  # the most sequences running at once (holding KV blocks)
        self._freed: list[int] = []  # seq ids freed since the last non-empty batch
        # the last batch _schedule_decodes built and its sequences, item for item: update()
        # reads them from it instead of looking every item up
        self._decoded: tuple[ScheduledBatch, list[Sequence]] | None = None
        # that pair once update() applied the batch with every sequence still running, until
        # the running list changes: the next decode step continues it (ScheduledBatch.continues)
        self._continuable: tuple[ScheduledBatch, list[Sequence]] | None = None
        self._num_batches = 0  # batches handed out (ScheduledBatch.index)
        self.decode_fast_path = True  # False: decode-only steps take the general loop too (tests)

    def add(self, seq: Sequence) -> None:
        seq.stoppers = seq.stop_token_ids | self.eos_token_ids
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        preempted = False
        previous, self._continuable = self._continuable, None

        if self.decode_fast_path and self._schedule_decodes(batch, budget, previous):
            budget -= batch.num_tokens
            i = len(self.running)
        else:
            i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                preempted = True
                victim = self.running.pop()  # newest; never one already scheduled (index >= i)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._add_to_batch(batch, seq, n)
                budget -= n
                i += 1

        if not preempted:
            budget = self._admit_waiting(batch, budget)
        if self._decoded is not None and (self._decoded[0] is not batch or len(batch.seqs) != len(self._decoded[1])):
            self._decoded = None  # admissions joined the decodes: update() looks items up
        if batch.seqs:  # an empty batch never reaches the runner: keep them for the next one
            batch.freed_seq_ids, self._freed = self._freed, []
            batch.index, self._num_batches = self._num_batches, self._num_batches + 1
            batch.continues = (self._decoded is not None and self._decoded[0] is batch and previous is not None
                               and previous[0].index == batch.index - 1 and not batch.freed_seq_ids)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int,
                          previous: tuple[ScheduledBatch, list[Sequence]] | None = None) -> bool:
        """The common step, in one pass: every running sequence decodes one token, within
        the budget, and the few whose new token starts a block get one each. The same
        batch and block ids as the general loop; False (no block taken) when it does not
        apply: a prefill chunk among them, too small a budget, or too few free blocks.
        previous: the continuable batch and its sequences (the running ones, in order),
        whose items are moved one token on and reused."""
        running = self.running
        if not running or len(running) > budget:
            return False
        bm = self.block_manager
        bs = bm.block_size
        needy: list[list[int]] = []  # tables that need one more block
        if previous is not None and len(previous[1]) == len(running):
            items, seqs = previous[0].seqs, previous[1]
            for seq, it in zip(seqs, items):  # each computed all its tokens, then got one more
                start, table = seq.num_computed_tokens, seq.block_table
                if start >= len(table) * bs:
                    needy.append(table)
                it.token_ids = [seq.token_ids[start]]
                it.start_pos = start
                it.num_generated += 1
            if needy and not bm.append_blocks(needy):
                return False
            batch.seqs, batch.num_tokens = items, len(items)
            self._decoded = (batch, seqs)
            return True
        items = []
        add = items.append
        item = ScheduledSeq
        for seq in running:
            tokens, start, table = seq.token_ids, seq.num_computed_tokens, seq.block_table
            if len(tokens) - start != 1:
                return False
            if start >= len(table) * bs:
                needy.append(table)
            num_prompt = seq.num_prompt_tokens
            add(item(seq.seq_id, [tokens[start]], start, table, True, seq.params, seq.seed,
                     start + 1 - num_prompt, tokens, num_prompt, seq.constraint))
        if needy and not bm.append_blocks(needy):
            return False
        batch.seqs = items
        batch.num_tokens = len(items)
        self._decoded = (batch, list(running))
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        """First come, first served, except that a request whose next uncached prompt
        block is being computed by another request waits a step and then hits the cache
        (several requests sharing a new prefix compute it once)."""
        bm = self.block_manager
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            # a prompt to score computes every position: cached blocks hold K/V but no logits
            scoring = seq.scores_prompt
            cached = [] if scoring else bm.find_cached_prefix(seq)
            if not scoring and bm.waits_for_in_flight(seq, len(cached)):
                deferred.append(seq)
                continue
            # A prompt entirely in cache still recomputes its last token, for its logits.
            num_cached = min(len(cached) * bm.block_size, seq.num_tokens - 1)
            n = min(seq.num_tokens - num_cached, budget)
            if not bm.allocate(seq, num_cached + n, cached):
                self.waiting.appendleft(seq)
                break
            if bm.enable_prefix_caching:
                bm.record_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            bm.mark_in_flight(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.peak_running = max(self.peak_running, len(self.running))
            self._add_to_batch(batch, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        batch.seqs.append(ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start:start + n],
            start_pos=start,
            block_table=seq.block_table,
            sample=start + n == seq.num_tokens,
            params=seq.params,
            seed=seq.seed,
            num_generated=seq.num_output_tokens,
            all_token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            constraint=seq.constraint,
        ))
        if seq.prompt_logprobs is not None:
            item = batch.seqs[-1]
            item.prompt_logprobs, item.prompt_logprobs_from = seq.params.prompt_logprobs, len(seq.prompt_logprobs)
            if not item.prompt_positions():
                item.prompt_logprobs = None
        batch.num_tokens += n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._freed.append(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- results ------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, output: StepOutput) -> list[Sequence]:
        """Apply one step's results; returns the sequences that finished (blocks freed)."""
        decoded, self._decoded = self._decoded, None
        if decoded is not None and decoded[0] is batch:  # every item one token, sampled
            finished = self._update_decodes(decoded[1], output)
            self._continuable = None if finished else decoded
        else:
            finished = self._update_items(batch, output)
        if finished:
            for seq in finished:
                self._finish(seq)
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return finished

    def _update_items(self, batch: ScheduledBatch, output: StepOutput) -> list[Sequence]:
        by_id = {seq.seq_id: seq for seq in self.running}
        sampled = iter(output.sampled_token_ids)
        logprobs = iter(output.logprobs) if output.logprobs is not None else None
        bm = self.block_manager
        # a block fills at most every block_size tokens: look at the prefix cache only then
        cache_from = bm.block_size if bm.enable_prefix_caching else None
        finished: list[Sequence] = []
        for item in batch.seqs:
            seq = by_id[item.seq_id]
            computed = seq.num_computed_tokens = seq.num_computed_tokens + len(item.token_ids)
            if cache_from is not None and computed >= (seq.num_hashed_blocks + 1) * cache_from:
                bm.cache_full_blocks(seq)
            if item.prompt_logprobs is not None:
                seq.prompt_logprobs += output.prompt_logprobs[item.seq_id]
            if item.sample:
                token = next(sampled)
                tokens = seq.token_ids
                tokens.append(token)
                if logprobs is not None:
                    self._add_logprobs(seq, next(logprobs, None))
                # only these can end it: the cheap test first, the rules in _check_stop
                if (len(tokens) >= seq.token_limit or token in seq.stoppers) and self._check_stop(seq):
                    finished.append(seq)
        return finished

    def _update_decodes(self, seqs: list[Sequence], output: StepOutput) -> list[Sequence]:
        """update() for a batch of _schedule_decodes: seqs[i] computed one token and sampled
        output's i-th; the same effects as _update_items, without the lookups."""
        bm = self.block_manager
        cache_from = bm.block_size if bm.enable_prefix_caching else 1 << 62
        finished: list[Sequence] = []
        logprobs = output.logprobs
        for seq, token in zip(seqs, output.sampled_token_ids):
            computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
            if computed >= (seq.num_hashed_blocks + 1) * cache_from:
                bm.cache_full_blocks(seq)
            tokens = seq.token_ids
            tokens.append(token)
            if (len(tokens) >= seq.token_limit or token in seq.stoppers) and self._check_stop(seq):
                finished.append(seq)
        if logprobs is not None:  # after the tokens, as _update_items: a stop test reads no logprob
            for seq, lp in zip(seqs, logprobs):
                self._add_logprobs(seq, lp)
        return finished

    @staticmethod
    def _add_logprobs(seq: Sequence, lp) -> None:
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob

    def _check_stop(self, seq: Sequence) -> bool:
        token = seq.token_ids[-1]
        may_stop = seq.num_output_tokens > seq.params.min_tokens
        if may_stop and token in seq.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif may_stop and not seq.params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens:
            seq.finish_reason = "length"
        else:
            return False
        return True

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        self._freed.append(seq.seq_id)

    def kv_stats(self) -> KVStats:
        bm = self.block_manager
        bs, used = bm.block_size, bm.num_used_blocks
        # Between steps each running table covers exactly its computed tokens, so the only
        # empty slots are the tails of last blocks (a shared block is always full).
        empty = sum(len(s.block_table) * bs - s.num_computed_tokens for s in self.running)
        return KVStats(
            block_size=bs, num_blocks=bm.num_blocks, used_blocks=used,
            free_blocks=bm.num_free_blocks, free_cached_blocks=bm.num_free_cached,
            peak_used_blocks=bm.peak_used_blocks, stored_tokens=used * bs - empty,
            allocated_slots=used * bs, prefix_query_tokens=bm.query_tokens,
            prefix_hit_tokens=bm.hit_tokens, num_preemptions=self.num_preemptions,
            peak_running_seqs=self.peak_running, touched_blocks=bm.touched_blocks)

    def stop(self, seq: Sequence, stop_reason: str) -> None:
        """Finish a running sequence for a reason found outside the scheduler (a stop
        string in its text); its blocks are freed at once."""
        assert seq.status is SequenceStatus.RUNNING
        seq.finish_reason, seq.stop_reason = "stop", stop_reason
        self._continuable = None
        self.running.remove(seq)
        self._finish(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Drop a sequence wherever it is; its blocks are freed at once. Safe whatever
        state the sequence is in (an interrupt may have cut admission short)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._continuable = None
        _discard(self.waiting, seq)
        _discard(self.running, seq)
        seq.finish_reason = reason
        self._finish(seq)


def _discard(queue, seq: Sequence) -> None:
    try:
        queue.remove(seq)
    except ValueError:  # not there
        pass
