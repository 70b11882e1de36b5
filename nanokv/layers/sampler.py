"""Batched sampling with per-row settings, at a cost close to greedy.

Order (vLLM's): token mask (allowed_token_ids, bad_words: a packed bitmask per constrained
row) -> logit_bias -> min_tokens mask -> penalties -> [logprobs taken here] -> greedy argmax,
or temperature -> top-k -> top-p -> min-p -> one draw. Greedy rows take the argmax of the
penalised logits and are exact. On the C kernels the token mask is not written into the
logits: each kernel reads a banned token as -inf where it reads the row (a bit test per
token, ops.RowMasks); logit_bias, min_tokens bans and penalties leave a -inf logit -inf
and touch allowed tokens alike, so every step after sees what masking first gives.

A sampled row inverts its CDF with one uniform u: its kept tokens, most likely first (ties:
lower id first), weighted w = exp((logit - max) / T); the token is the first whose
cumulative weight exceeds u times the kept weight. Only candidates are sorted: the row's
top_k tokens, or its top CANDIDATES when top_k is off, found from block maxima
(`top_candidates`). Where top-k, top-p or min-p ends inside the candidates (the usual case)
that is the whole draw; with top_k off, top-p's cut needs the weight Z of the whole
vocabulary, one pass of exp2 and a sum. Where the kept set may reach past the candidates
(temperature only, or a nucleus or min-p set larger than them), u * Z is located in the
candidates first and then among the other tokens in id order; a token drawn there that
top-p or min-p drops is rejected, and the row draws again among the tokens more likely
than it. That is exact: the kept set is every token above some weight, and each draw is
proportional to w over a superset of it. Only rows whose draw lands past their candidates
pay for those passes.

A seeded row's uniforms are a hash of (seed, token index, draw number) and nothing else, so
its token depends neither on the batch nor on preemption; the other rows draw from the
engine's generator. On the CPU the full-vocabulary passes go a few MiB of rows at a time,
in one buffer kept across steps, so that each chunk's passes run in cache.

With the CPU kernels (kernels/csrc/sampler.c, where they build) the same draw runs in C
row by row, each row in cache from its candidates to its token (nk_sample_rows, for rows
with top_k off: the draws past the candidates, which flat distributions make common, cost
a pass or two of a row in L2 instead of several over the batch); the candidates of the
other rows and logprobs' statistics are C calls too. Its later uniforms (redraws) are
seeded_uniform's of a key: the row's own, or one drawn from the generator.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

import nanokv.kernels as kernels
import nanokv.kernels.ops as ops
from nanokv.cpu_threads import one_thread

CANDIDATES = 64  # tokens sorted per row when top_k is off (SmolLM2 at T 0.8: 88% of nuclei fit)
_CHUNK_BYTES = 4 << 20  # CPU: rows of token weights per chunk
_MASK = (1 << 64) - 1
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: spreads (seed, step) pairs
_SERIAL_ELEMENTS = 1 << 20  # greedy_tokens: up to this many logits on one thread (about 0.1 ms)
_ARGMAX_BLOCK = 128  # greedy_tokens: the largest block (a power of two dividing the vocabulary)


@dataclass
class SamplingTensors:
    """Per-row sampling settings for the N sampled rows of a step (built by the runner)."""

    temperatures: torch.Tensor  # [N] float32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where off
    top_p: torch.Tensor | None = None  # [N] float32, 1 where off
    min_p: torch.Tensor | None = None  # [N] float32, 0 where off
    # penalties, only when some row asks for them: per-row values, and each penalised row's
    # distinct prompt and output tokens as (row, token id) pairs
    repetition: torch.Tensor | None = None  # [N] float32
    presence: torch.Tensor | None = None  # [N] float32
    frequency: torch.Tensor | None = None  # [N] float32
    penalty_rows: torch.Tensor | None = None  # [P] int64
    penalty_ids: torch.Tensor | None = None  # [P] int64
    penalty_counts: torch.Tensor | None = None  # [P] float32: times generated (0: prompt only)
    # min_tokens: ([R] rows, [K] token ids) pairs, every id masked in each of the rows
    banned: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # token masks: [M] rows, each with its [M, (V + 31) // 32] int32 words (vLLM's packed
    # bitmask, nanokv/constraints.py: bit clear = token banned); None when no row has one
    mask_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # logit_bias: [B] (row, token id, bias) triples, added to the logits
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    seeded: list[tuple[int, int]] | None = None  # (row, seed for this token) for seeded rows
    max_logprobs: int | None = None  # largest top-N asked for, None when no row asks
    logprob_rows: torch.Tensor | None = None  # [A] int64 rows that ask (None: all rows)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [N] int64
    # for the rows that ask for logprobs (SamplingTensors.logprob_rows), in that order
    logprobs: torch.Tensor | None = None  # [A] logprob of the sampled token
    ranks: torch.Tensor | None = None  # [A] 1-based rank of the sampled token
    top_ids: torch.Tensor | None = None  # [A, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # [A, max_logprobs]


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def list_tensor(values, dtype: torch.dtype = torch.int64, device: torch.device | None = None) -> torch.Tensor:
    """A list of numbers as a [len] tensor (then on device): through array, several times
    faster than torch.tensor, which inspects every element (80 us for 256 floats)."""
    host = torch.frombuffer(array(_ARRAY_CODES[dtype], values), dtype=dtype) if len(values) else \
        torch.empty(0, dtype=dtype)
    return host if device is None or torch.device(device).type == "cpu" else host.to(device)


_INDEX_MIX, _KEY_MASK = 0xBF58476D1CE4E5B9, (1 << 63) - 1


def seed_for_token(seed: int, index: int) -> int:
    """The key of a seeded request's index-th token: independent of the batch, of its
    position in it and of preemption."""
    return (seed * _SEED_MIX + index * _INDEX_MIX + 1) & _KEY_MASK  # mod 2 ** 63, for any sign


def seed_keys(rows, picked: list[int]) -> list[tuple[int, int]]:
    """(i, seed_for_token(rows[i].seed, rows[i].num_generated)) for the picked rows that
    have a seed (ScheduledSeq rows): seed_for_token, inlined for hundreds of rows a step."""
    mix, index_mix, mask = _SEED_MIX, _INDEX_MIX, _KEY_MASK
    return [(i, (s.seed * mix + s.num_generated * index_mix + 1) & mask) for i in picked
            if (s := rows[i]).seed is not None]


def seeded_uniform(key: int, draw: int) -> float:
    """The draw-th uniform in [0, 1) of a token key (splitmix64); 24 bits, so that it is
    exact in float32 and below 1."""
    x = (key + (draw + 1) * _SEED_MIX) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((x ^ (x >> 31)) >> 40) / (1 << 24)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [N, V] logits ([N] int64), the same ids (ties: the lowest).
    On the CPU torch's argmax does not vectorise (several times slower than amax), so the
    row maxima come from block maxima (amax), and argmax runs only over the block maxima
    and the one block per row that holds the maximum; up to _SERIAL_ELEMENTS logits on one
    thread. Elsewhere, or for a vocabulary with no block size dividing it, or a row with a
    NaN: argmax itself."""
    n, vocab = logits.shape
    block = _ARGMAX_BLOCK
    while vocab % block:
        block //= 2
    if logits.device.type != "cpu" or block < 16 or n * vocab < (1 << 15) or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    if n * vocab <= _SERIAL_ELEMENTS:
        with one_thread():
            return _block_argmax(logits, block)
    return _block_argmax(logits, block)


def _block_argmax(logits: torch.Tensor, block: int) -> torch.Tensor:
    n, vocab = logits.shape
    blocks = logits.view(n, vocab // block, block)
    block_max = blocks.amax(dim=2)  # [N, V / block]
    row_max = block_max.amax(dim=1, keepdim=True)  # [N, 1]
    if row_max.isnan().any():  # argmax takes a NaN as the maximum; == never matches one
        return logits.argmax(dim=-1)
    first = (block_max == row_max).to(torch.uint8).argmax(dim=1)  # [N] the first block holding it
    within = blocks[torch.arange(n), first].argmax(dim=1)  # [N, block] -> [N]
    return first * block + within


class Sampler:
    """Samples one token per row. The logits are overwritten where token masks, logit_bias,
    min_tokens masks or penalties apply."""

    def __init__(self, cpu_kernels: bool | None = None):
        self._scratch = torch.empty(0)  # two CPU chunk buffers, kept: fresh memory page-faults
        self._cpu_kernels = cpu_kernels  # CPU logits on the C kernels; None: where they build (decided once)

    def _kernels(self, logits: torch.Tensor) -> bool:
        if logits.device.type != "cpu":
            return False
        if self._cpu_kernels is None:
            self._cpu_kernels = kernels.available()
        return self._cpu_kernels

    def __call__(self, logits: torch.Tensor, t: SamplingTensors,
                 generator: torch.Generator | None = None) -> SamplerOutput:
        logits = logits.float()  # [N, V]
        c = self._kernels(logits)
        if c:
            logits = logits.contiguous()
        masks = None
        if t.mask is not None:  # C: read through the mask where each row is read, no pass of its own
            if c:
                masks = ops.RowMasks.build(len(logits), t.mask_rows, t.mask)
            else:
                apply_token_mask(logits, t.mask_rows, t.mask)
        if t.bias_ids is not None:
            logits.index_put_((t.bias_rows, t.bias_ids), t.bias_values, accumulate=True)
        if t.banned is not None:
            for rows, ids in t.banned:
                logits[rows[:, None], ids] = float("-inf")
        if t.penalty_ids is not None:
            apply_penalties(logits, t)
        if t.all_greedy:
            tokens = ops.argmax_rows(logits, None, masks) if c else greedy_tokens(logits)
        else:
            tokens = self._draw(logits, t, generator, masks)
        out = SamplerOutput(tokens)
        if t.max_logprobs is not None:
            self._logprobs(logits, t, out, masks)
        return out

    def _logprobs(self, logits: torch.Tensor, t: SamplingTensors, out: SamplerOutput,
                  masks: ops.RowMasks | None = None) -> None:
        """The asking rows' log-probabilities under the penalised logits (before temperature
        and top-k/p): the sampled token's, its rank, the top max_logprobs. Each is its logit
        minus the row's log-sum-exp, so no [A, V] log_softmax is built."""
        rows = t.logprob_rows
        tokens = out.tokens if rows is None else out.tokens[rows]
        picked = logits.gather(1, tokens[:, None]) if rows is None else logits[rows, tokens][:, None]  # [A, 1]
        if masks is not None:  # a banned token (a row with nothing allowed) reads as -inf
            picked = torch.where(_allowed(masks, rows, tokens)[:, None], picked, float("-inf"))
        k = t.max_logprobs
        if self._kernels(logits):  # row by row: its top k, log-sum-exp and rank in one visit
            lse, above, vals, ids = ops.logprobs(logits, rows, picked.squeeze(1), k, _block(logits.shape[1], k),
                                                 masks)
        else:
            m = logits.amax(dim=1, keepdim=True)
            m = m if rows is None else m[rows]
            scale = torch.full_like(m, math.log2(math.e))
            sums = torch.cat([e.sum(dim=1) for _, e in _weights(logits, rows, m, scale, self._scratch_for(logits))])
            lse, above = m.squeeze(1) + sums.log(), _count_above(logits, rows, picked)
            vals, ids = top_candidates(logits, k, rows) if k > 0 else (None, None)
        out.logprobs = picked.squeeze(1) - lse
        out.ranks = above + 1
        if k > 0:
            out.top_ids, out.top_logprobs = ids, vals - lse[:, None]

    def _draw(self, logits: torch.Tensor, t: SamplingTensors, generator,
              masks: ops.RowMasks | None = None) -> torch.Tensor:
        """Greedy rows: argmax; the others: sample_rows (masks: the C kernels' token masks)."""
        temps = t.temperatures.tolist()
        sampled = [i for i, x in enumerate(temps) if x > 0]
        keys = dict(t.seeded or ())
        keys = [keys.get(i) for i in sampled]
        scratch = self._scratch_for(logits)
        c = self._kernels(logits)
        if len(sampled) == len(temps):
            return sample_rows(logits, None, RowSettings.build(t, None, logits.shape[1]), keys, generator, scratch, c,
                               masks)
        dev = logits.device
        tokens = torch.empty(len(temps), dtype=torch.long, device=dev)
        greedy = list_tensor([i for i, x in enumerate(temps) if x <= 0], device=dev)
        tokens[greedy] = ops.argmax_rows(logits, greedy, masks) if c else greedy_tokens(logits[greedy])
        rows = list_tensor(sampled, device=dev)
        settings = RowSettings.build(t, rows, logits.shape[1])
        tokens[rows] = sample_rows(logits, rows, settings, keys, generator, scratch, c, masks)
        return tokens

    def _scratch_for(self, logits: torch.Tensor):
        return self._buffer if logits.device.type == "cpu" else None

    def _buffer(self, which: int, rows: int, vocab: int) -> torch.Tensor:
        """CPU buffer `which` (0 or 1) as [rows, vocab] float32, the same memory from step to step."""
        size = rows * vocab
        if 2 * size > self._scratch.numel():
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                self._scratch = torch.empty(2 * size)
        half = self._scratch.numel() // 2
        return self._scratch[which * half:which * half + size].view(rows, vocab)


class RowSettings(NamedTuple):
    """The settings of the n sampled rows ([n] tensors; None where no row uses one)."""

    scale: torch.Tensor  # float32 log2(e) / T: weights 2 ** ((logit - max) * scale) (exp2 is cheaper)
    k: torch.Tensor  # int64: candidates per row (top_k, or CANDIDATES when top_k is off)
    top_k_on: torch.Tensor  # bool
    top_p: torch.Tensor | None  # float32
    min_p: torch.Tensor | None  # float32
    k_list: list[int]  # k on the host
    off_list: list[bool]  # rows with top_k off, on the host: they need the full weight Z

    @staticmethod
    def build(t: SamplingTensors, rows: torch.Tensor | None, vocab: int) -> "RowSettings":
        def pick(x):
            return x if x is None or rows is None else x[rows]

        temps = pick(t.temperatures)
        top_k = pick(t.top_k)
        off = min(CANDIDATES, vocab)
        values = [vocab] * len(temps) if top_k is None else top_k.tolist()
        k_list = [k if k < vocab else off for k in values]
        k = list_tensor(k_list, device=temps.device)
        on = torch.zeros_like(k, dtype=torch.bool) if top_k is None else top_k < vocab
        return RowSettings(math.log2(math.e) / temps, k, on, pick(t.top_p), pick(t.min_p), k_list,
                           [x >= vocab for x in values])

    def chunk(self, rows: slice) -> "RowSettings":
        return RowSettings(*(None if x is None else x[rows] for x in self))

    def select(self, index: torch.Tensor, positions: list[int]) -> "RowSettings":
        """The rows at positions (also as index, a tensor)."""
        return RowSettings(*(None if x is None else [x[i] for i in positions] if isinstance(x, list) else x[index]
                             for x in self))


def sample_rows(logits: torch.Tensor, rows: torch.Tensor | None, s: RowSettings,
                keys: list[int | None], generator: torch.Generator | None, scratch=None,
                cpu_kernels: bool = False, masks: ops.RowMasks | None = None) -> torch.Tensor:
    """One token for each of the n sampled rows (rows of logits, None: all), [n] int64.
    keys: each row's seeded key (seed_for_token), None for the generator's draws.
    scratch(i, rows, vocab): CPU buffer i (0 or 1), reused from chunk to chunk (None: allocate).
    cpu_kernels: in C (CPU logits, contiguous): the candidates, and rows with top_k off whole;
    masks: token masks the C kernels read the rows through (the logits' rows are then read
    only by them)."""
    vocab = logits.shape[1]
    if cpu_kernels and any(s.off_list):
        return _sample_rows_c(logits, rows, s, keys, generator, scratch, masks)
    u = uniforms(keys, 0, generator, logits.device)
    vals, ids = top_candidates(logits, max(s.k_list), rows, cpu_kernels, masks)  # [n, k], largest first
    m = vals[:, :1]
    scale = s.scale[:, None]
    w = torch.exp2((vals - m) * scale)  # candidate weights, the largest 1
    w = torch.where(torch.arange(w.shape[1], device=w.device) < s.k[:, None], w, 0)
    cum = w.cumsum(dim=1)
    before = cum - w  # the weight of the more likely candidates
    last = (s.k - 1)[:, None]
    cand = cum.gather(1, last).squeeze(1)  # the weight of each row's candidates
    c = CANDIDATES
    # the kept set ends inside the candidates: top-k, or an option drops the last candidate
    cut = s.top_k_on | (s.k >= vocab) | (w.gather(1, last).squeeze(1) == 0)
    if s.min_p is not None:
        cut |= w.gather(1, last).squeeze(1) < s.min_p
    z = None
    z_top = cand  # what top-p is a fraction of: the top-k set, or the whole vocabulary
    tokens = torch.empty(len(keys), dtype=torch.long, device=logits.device)
    past = torch.zeros(len(keys), dtype=torch.bool, device=logits.device)
    if any(s.off_list):
        sums = []
        for part, e in _weights(logits, rows, m, scale, scratch):
            z_part = e.sum(dim=1)
            sums.append(z_part)
            inside = _inside(cut[part], before[part].gather(1, last[part]).squeeze(1), s.top_p, part,
                             torch.where(s.top_k_on[part], cand[part], z_part))
            uz = u[part] * z_part
            flat = ~s.top_k_on[part] & _flat(z_part, uz, c, vocab, s.top_p, s.min_p, part)
            past[part] = flat | (~inside & (uz >= cand[part]))
            # draw these rows now, while their weights are at hand; a flat row's draw walks
            # every token, as if it had no candidates
            for hit, n in ((past[part] & ~flat).nonzero().squeeze(1), c), (flat.nonzero().squeeze(1), 0):
                if len(hit) == 0:
                    continue
                rows_e = e
                if len(hit) < len(e):
                    out = None if scratch is None or n == 0 else scratch(1, len(hit), vocab)
                    rows_e = torch.index_select(e, 0, hit, out=out)
                at = hit + part.start
                tokens[at] = _draw_past_candidates(
                    rows_e, w[at, :n], cum[at, :n], ids[at, :n], uz[hit] - (cand[at] if n else 0), z_part[hit],
                    None if s.top_p is None else s.top_p[at], None if s.min_p is None else s.min_p[at],
                    [keys[i] for i in at.tolist()], generator)
        z = torch.cat(sums)
        z_top = torch.where(s.top_k_on, cand, z)
    keep = w > 0
    if s.top_p is not None:
        keep &= (before < s.top_p[:, None] * z_top[:, None]) | (s.top_p[:, None] >= 1)
    if s.min_p is not None:
        keep &= w >= s.min_p[:, None]
    inside = _inside(cut, before.gather(1, last).squeeze(1), s.top_p, slice(None), z_top)
    kept = cum.gather(1, (keep.sum(dim=1) - 1)[:, None]).squeeze(1)  # every option keeps a prefix
    limit = torch.where(inside, kept, cand)
    target = u * torch.where(inside, kept, z_top)
    drawn = _locate(cum, ids, torch.minimum(target, torch.nextafter(limit, torch.zeros_like(limit))))
    return torch.where(past, tokens, drawn)


def _sample_rows_c(logits: torch.Tensor, rows: torch.Tensor | None, s: RowSettings, keys: list[int | None],
                   generator: torch.Generator | None, scratch, masks: ops.RowMasks | None) -> torch.Tensor:
    """sample_rows on the C kernels: the rows with top_k off in one call (csrc/sampler.c's
    nk_sample_rows, the same draw row by row, each row in cache from its candidates to its
    token), the others through sample_rows with their candidates in C."""
    vocab, n = logits.shape[1], len(keys)
    c = min(CANDIDATES, vocab)
    if all(s.off_list):  # every row: no selection
        return ops.sample_rows(logits, rows, c, _block(vocab, c), s.scale, _first_uniforms_c(keys, generator),
                               _later_keys(keys, generator), s.top_p, s.min_p, masks)[0]
    off = [i for i, x in enumerate(s.off_list) if x]
    index = list_tensor(off)
    on = [i for i, x in enumerate(s.off_list) if not x]
    part = s.select(index, off)
    part_keys = [keys[i] for i in off]
    drawn, _ = ops.sample_rows(logits, index if rows is None else rows[index], c, _block(vocab, c), part.scale,
                               _first_uniforms_c(part_keys, generator), _later_keys(part_keys, generator),
                               part.top_p, part.min_p, masks)
    if not on:
        return drawn
    tokens = torch.empty(n, dtype=torch.long)
    tokens[index] = drawn
    others = list_tensor(on)
    tokens[others] = sample_rows(logits, others if rows is None else rows[others], s.select(others, on),
                                 [keys[i] for i in on], generator, scratch, True, masks)
    return tokens


def _first_uniforms_c(keys: list[int | None], generator: torch.Generator | None) -> torch.Tensor | None:
    """uniforms(keys, 0) as nk_sample_rows takes them: the generator's for the rows without a
    key, NaN for the seeded rows (the C draw computes their seeded_uniform(key, 0) itself);
    None when every row is seeded."""
    seeded = [i for i, k in enumerate(keys) if k is not None]
    if len(seeded) == len(keys):
        return None
    u = torch.rand(len(keys), generator=generator)
    u[seeded] = float("nan")
    return u


def _later_keys(keys: list[int | None], generator: torch.Generator | None) -> torch.Tensor:
    """[n] int64: the keys of each row's later uniforms (seeded_uniform(key, 1, 2, ...)) in the
    C draw: seeded rows' own, a key from the generator for the others."""
    free = [i for i, k in enumerate(keys) if k is None]
    out = list_tensor([0 if k is None else k for k in keys])
    if free:
        out[free] = torch.randint(0, 1 << 62, (len(free),), generator=generator)
    return out


def _flat(z: torch.Tensor, uz: torch.Tensor, c: int, vocab: int, top_p: torch.Tensor | None,
          min_p: torch.Tensor | None, part: slice) -> torch.Tensor:
    """Rows (of a chunk, top_k off) whose draw is past their c candidates whatever they are
    (csrc/sampler.c's flat_row): every weight is at most 1, so c candidates weigh at most c; when
    top_p's share of the row's weight z (all of it, top_p off) exceeds that and so does
    u * z, neither top-p nor the draw ends inside them (min_p off). Such a row draws among
    all its tokens in id order."""
    ok = (uz >= c) & (c < vocab)
    ok &= z > c if top_p is None else torch.where(top_p[part] < 1, top_p[part] * z > c, z > c)
    if min_p is not None:
        ok &= min_p[part] <= 0
    return ok


def _inside(cut: torch.Tensor, before_last: torch.Tensor, top_p: torch.Tensor | None, part: slice,
            z_top: torch.Tensor) -> torch.Tensor:
    """Rows whose kept set ends inside their candidates: cut already, or top-p drops the last
    candidate (the weight before it reaches top_p * z_top)."""
    if top_p is None:
        return cut
    return cut | ((before_last >= top_p[part] * z_top) & (top_p[part] < 1))


def _weights(logits: torch.Tensor, rows: torch.Tensor | None, m: torch.Tensor, scale: torch.Tensor, scratch):
    """(part, e) for chunks of the rows (rows of logits, None: all): e [c, V] every token's
    weight 2 ** ((logit - max) * scale). On the CPU a chunk is a few MiB, in one buffer
    that the next chunk reuses, so that its passes run in cache; elsewhere one chunk."""
    n, vocab = len(m), logits.shape[1]
    step = max(1, _CHUNK_BYTES // (4 * vocab)) if logits.device.type == "cpu" else n
    for start in range(0, n, step):
        part = slice(start, min(n, start + step))
        out = None if scratch is None else scratch(0, part.stop - start, vocab)
        if rows is None:
            e = torch.sub(logits[part], m[part], out=out)
        else:
            e = torch.index_select(logits, 0, rows[part], out=out).sub_(m[part])
        yield part, e.mul_(scale[part]).exp2_()


def _draw_past_candidates(e, w, cum, ids, rest, z, top_p, min_p, keys, generator) -> torch.Tensor:
    """Locate the rest of each row's draw among the tokens past its candidates (id order);
    a token top-p or min-p drops is rejected, and the row draws again among the tokens
    more likely than it, candidates first. e: [r, V] every token's weight (overwritten),
    w / cum / ids: [r, CANDIDATES], rest / z: [r]."""
    e.scatter_(1, ids, 0)  # the tokens past the candidates
    tokens = torch.empty(len(keys), dtype=torch.long, device=e.device)
    live = torch.arange(len(keys), device=e.device)  # rows still drawing
    state = [e, w, cum, ids, z, top_p, min_p]
    draw = 1
    while True:
        e, w, cum, ids, z, top_p, min_p = state
        pick = _locate_by_blocks(e, rest)
        wt = e.gather(1, pick[:, None])  # [r, 1]
        ok = wt.squeeze(1) > 0  # 0: u * Z rounded past a tail of no weight; draw again
        if top_p is not None:
            above = _sum_above(e, wt) + torch.where(w > wt, w, 0).sum(dim=1)
            ok &= (above < top_p * z) | (top_p >= 1)
        if min_p is not None:
            ok &= wt.squeeze(1) >= min_p
        tokens[live[ok]] = pick[ok]
        again = (~ok).nonzero().squeeze(1)
        if len(again) == 0:
            return tokens
        # every token as likely as a rejected one is dropped too: draw again above it
        live, wt, keys = live[again], wt[again], [keys[i] for i in again.tolist()]
        state = [None if x is None else x[again] for x in state]
        e, w, cum, ids = state[:4]
        _zero_up_to(e, wt)
        cand = torch.where(w > wt, w, 0).sum(dim=1)
        target = uniforms(keys, draw, generator, e.device) * (cand + e.sum(dim=1))
        draw += 1
        inside = target < cand
        if cum.shape[1]:  # none for a flat row
            tokens[live[inside]] = _locate(cum, ids, target)[inside]
        past = (~inside).nonzero().squeeze(1)
        if len(past) == 0:
            return tokens
        live, rest, keys = live[past], (target - cand)[past], [keys[i] for i in past.tolist()]
        state = [None if x is None else x[past] for x in state]


def _locate_by_blocks(e: torch.Tensor, target: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The first token (id order) whose cumulative weight exceeds target, per row of e
    [r, V]: block sums first, then a cumulative sum inside one block (cheaper than the
    cumulative sum of the row)."""
    r, vocab = e.shape
    block = min(block, vocab)
    full = vocab // block * block
    sums = e[:, :full].view(r, -1, block).sum(dim=2)
    if full < vocab:
        sums = torch.cat([sums, e[:, full:].sum(dim=1, keepdim=True)], dim=1)
    cs = sums.cumsum(dim=1)
    target = torch.minimum(target.clamp(min=0), torch.nextafter(cs[:, -1], torch.zeros_like(target)))
    j = torch.searchsorted(cs, target[:, None], right=True).clamp(max=cs.shape[1] - 1)  # [r, 1]
    target = target[:, None] - (cs.gather(1, j) - sums.gather(1, j))
    idx = (j * block + torch.arange(block, device=e.device)).clamp(max=vocab - 1)  # [r, block]
    inner = torch.where(idx < vocab, e.gather(1, idx), 0).cumsum(dim=1)
    target = torch.minimum(target, torch.nextafter(inner[:, -1:], torch.zeros_like(target)))
    k = torch.searchsorted(inner, target, right=True).clamp(max=block - 1)
    return idx.gather(1, k).squeeze(1)


def _sum_above(e: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """Per row of e [r, V], the sum of the weights above wt [r, 1]. On the CPU row by row:
    threshold takes a scalar, and a compare against a [r, 1] column is not vectorized."""
    if e.device.type != "cpu":
        return torch.where(e > wt, e, 0).sum(dim=1)
    return torch.stack([F.threshold(row, x, 0.0).sum() for row, x in zip(e, wt.squeeze(1).tolist())])


def _count_above(logits: torch.Tensor, rows: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Per row (rows of logits, None: all), how many logits exceed x [n, 1]."""
    if logits.device.type != "cpu":
        return ((logits if rows is None else logits[rows]) > x).sum(dim=1)
    index = range(len(logits)) if rows is None else rows.tolist()
    return torch.tensor([int(torch.count_nonzero(logits[i] > v)) for i, v in zip(index, x.squeeze(1).tolist())])


def _zero_up_to(e: torch.Tensor, wt: torch.Tensor) -> None:
    """Zero every weight of e [r, V] at or below wt [r, 1], in place."""
    if e.device.type != "cpu":
        e.masked_fill_(e <= wt, 0)
        return
    for row, x in zip(e, wt.squeeze(1).tolist()):
        F.threshold_(row, x, 0.0)


def _locate(cum: torch.Tensor, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative weight first exceeds target, per row."""
    idx = torch.searchsorted(cum, target[:, None].contiguous(), right=True).clamp(max=cum.shape[1] - 1)
    return ids.gather(1, idx).squeeze(1)


def uniforms(keys: list[int | None], draw: int, generator: torch.Generator | None,
             device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, float32: seeded rows from their key, the others from
    the generator."""
    seeded = [(i, seeded_uniform(k, draw)) for i, k in enumerate(keys) if k is not None]
    if len(seeded) == len(keys):
        return list_tensor([x for _, x in seeded], torch.float32, device)
    u = torch.rand(len(keys), generator=generator, device=device)
    if seeded:
        rows, values = zip(*seeded)
        u[list_tensor(rows, device=device)] = list_tensor(values, torch.float32, device)
    return u


def top_candidates(logits: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                   cpu_kernels: bool = False, masks: ops.RowMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row (rows of logits, None: all) and their token ids,
    [n, k] each, largest first (ties: lower id first). The k largest lie in the k blocks
    with the largest maxima, so after one pass of block maxima only those are searched.
    cpu_kernels: in C, row by row (CPU logits, contiguous), reading through masks if given."""
    vocab = logits.shape[1]
    n = len(logits) if rows is None else len(rows)
    block = _block(vocab, k)
    if cpu_kernels:
        return ops.top_candidates(logits, k, rows, block, masks)
    if block == 0:
        vals, ids = (logits if rows is None else logits[rows]).topk(k, dim=1, sorted=False)
    else:
        num_blocks = vocab // block
        full = num_blocks * block
        blocks = logits[:, :full].view(len(logits), num_blocks, block)
        maxima = blocks.amax(dim=2)  # [N, num_blocks], for every row: cheaper than picking rows first
        top = (maxima if rows is None else maxima[rows]).topk(k, dim=1, sorted=False).indices  # [n, k]
        index = (torch.arange(n, device=logits.device) if rows is None else rows)[:, None]
        pool = blocks[index, top].view(n, k * block)
        pool_ids = (top[:, :, None] * block + torch.arange(block, device=logits.device)).view(n, k * block)
        if full < vocab:  # the ragged end joins every row's pool
            pool = torch.cat([pool, logits[:, full:] if rows is None else logits[rows, full:]], dim=1)
            pool_ids = torch.cat([pool_ids, torch.arange(full, vocab, device=logits.device).expand(n, -1)], dim=1)
        vals, pos = pool.topk(k, dim=1, sorted=False)
        ids = pool_ids.gather(1, pos)
    ids, order = ids.sort(dim=1)
    vals, order = vals.gather(1, order).sort(dim=1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def _block(vocab: int, k: int) -> int:
    """top_candidates' block size for k of vocab: about sqrt(vocab / k), a power of two; 0 (the
    whole row searched) where blocks would be under 8 or fewer than 4 k."""
    block = 2 ** round(math.log2(max(1.0, math.sqrt(vocab / max(k, 1)))))
    return 0 if block < 8 or vocab // block < 4 * k else block


_BIT = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)  # bit b of an int32 word


def unpack_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, (vocab + 31) // 32] int32 packed words -> [M, vocab] bool, True where allowed."""
    bits = (mask[:, :, None] & _BIT.to(mask.device)) != 0  # [M, W, 32]
    return bits.view(len(mask), -1)[:, :vocab]


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Each banned token (its bit clear in mask [M, W] int32) of the rows rows [M] of
    logits [N, V] set to -inf, in place, as tensor ops (CUDA, torch; the C kernels read
    the mask where they read each row instead: ops.RowMasks)."""
    allowed = unpack_mask(mask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


def _allowed(masks: ops.RowMasks, rows: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """[A] bool: whether each token tokens [A] is allowed in its row (rows of the logits,
    None: all) by masks (rows without a mask allow everything)."""
    index = masks.index if rows is None else masks.index[rows]
    words = masks.words[index.clamp(min=0), tokens >> 5].long()
    return (index < 0) | ((words >> (tokens & 31)) & 1 != 0)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> None:
    """vLLM's definitions, in place on the (row, token) pairs seen: repetition divides
    positive / multiplies negative logits of tokens in the prompt or output; frequency and
    presence subtract per generated occurrence / once per generated token. A finite logit
    stays finite: near float32's limits the penalty saturates at the largest float (a
    logit of 1e37 divided by 0.01 was inf, and inf - inf made the row's logprobs NaN);
    a banned (-inf) logit stays banned."""
    rows, ids, counts = t.penalty_rows, t.penalty_ids, t.penalty_counts
    vals = logits[rows, ids]
    finite = torch.isfinite(vals)
    rep = t.repetition[rows]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals -= t.frequency[rows] * counts + t.presence[rows] * (counts > 0)
    big = torch.finfo(vals.dtype).max
    logits[rows, ids] = torch.where(finite, vals.clamp(-big, big), vals)


class TokenCounts:
    """One sequence's penalty state, kept across its steps: its distinct prompt and output
    tokens, and how often each was generated. update() counts the tokens generated since
    the last call, so a step costs the new tokens, not the sequence."""

    __slots__ = ("tokens", "num_prompt", "ids", "counts", "index", "num_counted")

    def __init__(self, tokens: list[int], num_prompt: int):
        self.tokens = tokens  # the sequence's own list, which only grows
        self.num_prompt = num_prompt
        self.index = {tok: i for i, tok in enumerate(dict.fromkeys(tokens[:num_prompt]))}
        self.ids = array("q", self.index)
        self.counts = array("f", bytes(4 * len(self.ids)))
        self.num_counted = 0

    def update(self) -> None:
        new = self.tokens[self.num_prompt + self.num_counted:]
        for tok in new:
            i = self.index.get(tok)
            if i is None:
                self.index[tok] = len(self.ids)
                self.ids.append(tok)
                self.counts.append(1.0)
            else:
                self.counts[i] += 1
        self.num_counted += len(new)
