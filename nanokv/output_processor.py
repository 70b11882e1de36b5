"""OutputProcessor: what the engine's token ids become for the user.

The scheduler sees token ids only. Here they become text: incremental detokenization,
stop strings found in that text (a stop string may span tokens), streaming deltas that
hold back what could still turn out to be the start of a stop string, vLLM-shaped
logprobs, and the grouping of a request's n samples into one RequestOutput. The engine
keeps the request bookkeeping (ids, sequences, the scheduler); the server turns these
deltas into SSE chunks.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from nanokv.detokenizer import IncrementalDetokenizer, decode_options
from nanokv.engine.sequence import Sequence
from nanokv.engine.types import ScheduledBatch
from nanokv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanokv.sampling_params import SamplingParams


@dataclass
class TextState:
    """Incremental text of one sample: kept for streaming requests and stop strings."""

    detok: IncrementalDetokenizer
    num_fed: int = 0  # output tokens fed to detok
    text_end: int | None = None  # cut here after a stop string
    sent_chars: int = 0  # streaming: text already returned
    sent_tokens: int = 0  # streaming: token ids already returned
    sent_final: bool = False  # streaming: the finished sample was reported
    stop_node: int = 0  # StopStrings state after the text so far


@dataclass
class RequestState:
    """One request: its samples (sequences) and, where text is watched, their text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    sink: list | None = None  # where its outputs go (LLM.generate/stream); None: step() returns them
    seqs: list[Sequence] = field(default_factory=list)
    text: list[TextState | None] = field(default_factory=list)
    stops: StopStrings | None = None  # params.stop's matcher, shared by the samples
    num_finished: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics.now)  # its times (the engine stamps them)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    cumulative: bool = False  # a streaming request whose outputs are the whole output so far
    so_far: RequestOutput | None = None  # cumulative: the last output
    sent_prompt_logprobs: bool = False  # streaming: prompt_logprobs went out (in the first delta, as vLLM)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._watched: dict[int, tuple[RequestState, int]] = {}  # seq id -> (request, sample index)
        self._last_stops: tuple[tuple[str, ...], StopStrings] | None = None  # for a batch of prompts

    def new_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                    stream: bool, seqs: list[Sequence]) -> RequestState:
        req = RequestState(request_id, prompt, token_ids, params, stream, seqs=seqs,
                           stops=self._stop_strings(params.stop) if params.stop else None)
        watched = stream or bool(params.stop)
        req.text = [TextState(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                     params.spaces_between_special_tokens))
                    if watched else None for _ in seqs]
        return req

    def _stop_strings(self, stops: list[str]) -> StopStrings:
        """The automaton of these stop strings: the last one built where they are the same
        (the prompts of one generate() call or server request share their params)."""
        key, last = tuple(stops), self._last_stops
        if last is not None and last[0] == key:
            return last[1]
        matcher = StopStrings(list(key))
        self._last_stops = (key, matcher)
        return matcher

    def add(self, req: RequestState) -> None:
        for seq, state in zip(req.seqs, req.text):
            if state is not None:
                self._watched[seq.seq_id] = (req, seq.index)

    def forget(self, seq: Sequence) -> None:
        self._watched.pop(seq.seq_id, None)

    def update_text(self, batch: ScheduledBatch, touched: dict[str, RequestState]) -> list[tuple[Sequence, str]]:
        """Detokenize the new tokens of watched samples (their requests go into touched);
        returns the samples whose text now holds a stop string, with the string."""
        hits = []
        if not self._watched:
            return hits
        for item in batch.seqs:
            entry = self._watched.get(item.seq_id) if item.sample else None
            if entry is None:
                continue
            req, index = entry
            seq, state = req.seqs[index], req.text[index]
            touched[req.request_id] = req
            if not req.params.detokenize:  # token ids only: no text to build
                continue
            new_ids = seq.output_token_ids[state.num_fed:]
            state.num_fed += len(new_ids)
            delta = state.detok.add(new_ids)
            if not delta or req.stops is None:
                continue
            # the automaton reads every character (its state spans steps); hits count after min_tokens
            state.stop_node, hit = req.stops.scan(state.stop_node, delta, len(state.detok.text) - len(delta))
            if hit is not None and seq.num_output_tokens > req.params.min_tokens:
                pos, stop = hit
                state.text_end = pos + (len(stop) if req.params.include_stop_str_in_output else 0)
                hits.append((seq, stop))
        return hits

    def output(self, req: RequestState) -> RequestOutput:
        """A streaming request's delta since its last output, else the whole request."""
        return self._delta_output(req) if req.stream else self._final_output(req)

    def _text(self, req: RequestState, index: int) -> str:
        """A finished sample's whole text."""
        seq, state, params = req.seqs[index], req.text[index], req.params
        if not params.detokenize:
            return ""
        if state is not None and state.text_end is not None:
            return state.detok.text[:state.text_end]
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens,
                                     **decode_options(params.spaces_between_special_tokens))

    def _completion(self, req: RequestState, index: int, text: str, token_ids: list[int],
                    logprobs_from: int) -> CompletionOutput:
        seq = req.seqs[index]
        out = CompletionOutput(index=index, text=text, token_ids=token_ids,
                               finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        if req.params.logprobs is not None:
            out.logprobs = self._format_logprobs(seq, logprobs_from, req.params.detokenize)
            out.cumulative_logprob = seq.cumulative_logprob
        return out

    def _final_output(self, req: RequestState) -> RequestOutput:
        outputs = [self._completion(req, i, self._text(req, i), seq.output_token_ids, 0)
                   for i, seq in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished=True,
                             metrics=req.metrics, num_cached_tokens=req.num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs(req))

    def _delta_output(self, req: RequestState) -> RequestOutput:
        outputs = []
        for i, (seq, state) in enumerate(zip(req.seqs, req.text)):
            if seq.is_finished:
                text = self._text(req, i)
            else:  # hold back what could still turn out to be the start of a stop string
                hold = req.stops.max_len - 1 if req.stops is not None else 0
                text = state.detok.text[:max(state.sent_chars, len(state.detok.text) - hold)]
            ids = seq.output_token_ids[state.sent_tokens:]
            if not ids and len(text) == state.sent_chars and (state.sent_final or not seq.is_finished):
                continue
            outputs.append(self._completion(req, i, text[state.sent_chars:], ids, state.sent_tokens))
            state.sent_chars, state.sent_tokens = len(text), seq.num_output_tokens
            state.sent_final = seq.is_finished
        prompt_logprobs = None
        if not req.sent_prompt_logprobs and outputs:
            prompt_logprobs = self._prompt_logprobs(req)
            req.sent_prompt_logprobs = prompt_logprobs is not None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs,
                             finished=req.finished, metrics=req.metrics, num_cached_tokens=req.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, req: RequestState) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then {token id: Logprob}
        with the prompt token and the top-N at each position (None: not asked, or the
        request failed before its prompt was scored)."""
        scored = req.seqs[0].prompt_logprobs if req.seqs else None
        if scored is None or len(scored) < len(req.prompt_token_ids) - 1:
            return None
        return [None] + self._entries(req.prompt_token_ids[1:], scored, req.params.detokenize)

    def _format_logprobs(self, seq: Sequence, start: int, detokenize: bool = True) -> list[dict[int, Logprob]]:
        """vLLM's shape: per generated token, {token id: Logprob} with the top-N and the
        sampled token (decoded_token None without detokenize)."""
        return self._entries(seq.output_token_ids[start:], seq.logprobs[start:], detokenize)

    def _entries(self, tokens: list[int], logprobs: list, detokenize: bool) -> list[dict[int, Logprob]]:
        """{token id: Logprob} per token: the top-N, then the token itself (with its rank)."""
        result = []
        for token, lp in zip(tokens, logprobs):
            entry = {tid: Logprob(val, rank) for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1)}
            entry.setdefault(token, Logprob(lp.logprob, lp.rank))
            result.append(entry)
            if not detokenize:
                continue
            ids = list(entry)
            for tid, piece in zip(ids, self.tokenizer.convert_ids_to_tokens(ids)):
                entry[tid].decoded_token = piece
        return result


def accumulate(so_far: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The output after so_far and then delta, as vLLM's CUMULATIVE kind returns it: each
    sample's text, token ids and logprobs from the start. A new object (lists are copied):
    an output already handed out does not change."""
    samples = {c.index: c for c in so_far.outputs} if so_far is not None else {}
    for c in delta.outputs:
        old = samples.get(c.index)
        if old is None:
            samples[c.index] = dataclasses.replace(c, token_ids=list(c.token_ids),
                                                   logprobs=None if c.logprobs is None else list(c.logprobs))
        else:
            logprobs = old.logprobs if c.logprobs is None else (old.logprobs or []) + c.logprobs
            samples[c.index] = dataclasses.replace(c, text=old.text + c.text, token_ids=old.token_ids + c.token_ids,
                                                   logprobs=logprobs)
    prompt_logprobs = delta.prompt_logprobs if so_far is None or delta.prompt_logprobs else so_far.prompt_logprobs
    return dataclasses.replace(delta, outputs=[samples[i] for i in sorted(samples)], prompt_logprobs=prompt_logprobs)


class StopStrings:
    """A request's stop strings as an Aho-Corasick automaton, built once per request:
    text is fed to it as it comes, each character once, so a step costs the new text
    whatever the number of stop strings.

    Its hits are those of str.find over the text just fed for every stop string: of the
    stop strings that end inside that text, the one that starts earliest; at the same
    start, the first listed.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.max_len = max(map(len, stops))
        # the trie: node (a prefix of some stop string; 0 the empty one) -> char -> node, in one
        # dict keyed by node << 21 | ord(char) (a dict per node took three times the memory)
        self.next: dict[int, int] = {}
        depth, first = [0], [-1]  # per node: its length; the first stop string spelling it (-1: none)
        for i, stop in enumerate(stops):
            node = 0
            for ch in stop:
                key = node << 21 | ord(ch)
                node = self.next.get(key)
                if node is None:
                    node = self.next[key] = len(depth)
                    depth.append(depth[key >> 21] + 1)
                    first.append(-1)
            if first[node] < 0:
                first[node] = i
        children: list[list[tuple[int, int]]] = [[] for _ in depth]  # node -> (ord(char), child)
        for key, child in self.next.items():
            children[key >> 21].append((key & _CHAR_MASK, child))
        # fail: the node of the node's longest proper suffix that is a node; longest: the
        # longest stop string that is a suffix of the node (itself or along its fail links)
        fail, longest = [0] * len(depth), [-1] * len(depth)
        queue = deque()
        for _, child in children[0]:
            longest[child] = child if first[child] >= 0 else -1
            queue.append(child)
        while queue:
            node = queue.popleft()
            for o, child in children[node]:
                f = fail[node]
                while f and (f << 21 | o) not in self.next:
                    f = fail[f]
                fail[child] = self.next.get(f << 21 | o, 0)
                longest[child] = child if first[child] >= 0 else longest[fail[child]]
                queue.append(child)
        self.fail = fail
        # per node: (length, index) of the longest stop string ending there, None: none
        self.hit = [None if m < 0 else (depth[m], first[m]) for m in longest]

    def scan(self, node: int, text: str, offset: int) -> tuple[int, tuple[int, str] | None]:
        """Feed text (which starts at character offset of the whole) from state node:
        the new state, and the hit (position in the whole text, stop string) or None."""
        nxt, fail, hits = self.next, self.fail, self.hit
        best = None  # (start, index)
        for end, ch in enumerate(text, offset + 1):
            o = ord(ch)
            while node and (node << 21 | o) not in nxt:
                node = fail[node]
            node = nxt.get(node << 21 | o, 0)
            hit = hits[node]
            if hit is not None and (best is None or (end - hit[0], hit[1]) < best):
                best = (end - hit[0], hit[1])
        return node, None if best is None else (best[0], self.stops[best[1]])


_CHAR_MASK = (1 << 21) - 1  # StopStrings' keys: a node's number above a character's code point
