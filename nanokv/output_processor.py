"""OutputProcessor: what the engine's token ids become for the user.

The scheduler sees token ids only. Here they become text: incremental detokenization,
stop strings found in that text (a stop string may span tokens), streaming deltas that
hold back what could still turn out to be the start of a stop string, vLLM-shaped
logprobs, and the grouping of a request's n samples into one RequestOutput. The engine
keeps the request bookkeeping (ids, sequences, the scheduler); the server turns these
deltas into SSE chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanokv.detokenizer import IncrementalDetokenizer
from nanokv.engine.sequence import Sequence
from nanokv.engine.types import ScheduledBatch
from nanokv.outputs import CompletionOutput, Logprob, RequestOutput
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
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._watched: dict[int, tuple[RequestState, int]] = {}  # seq id -> (request, sample index)

    def new_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                    stream: bool, seqs: list[Sequence]) -> RequestState:
        req = RequestState(request_id, prompt, token_ids, params, stream, seqs=seqs)
        watched = stream or bool(params.stop)
        req.text = [TextState(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
                    if watched else None for _ in seqs]
        return req

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
            new_ids = seq.output_token_ids[state.num_fed:]
            state.num_fed += len(new_ids)
            delta = state.detok.add(new_ids)
            if not delta or not req.params.stop or seq.num_output_tokens <= req.params.min_tokens:
                continue
            hit = _find_stop(state.detok.text, len(delta), req.params.stop)
            if hit is not None:
                pos, stop = hit
                state.text_end = pos + (len(stop) if req.params.include_stop_str_in_output else 0)
                hits.append((seq, stop))
        return hits

    def output(self, req: RequestState) -> RequestOutput:
        """A streaming request's delta since its last output, else the whole request."""
        return self._delta_output(req) if req.stream else self._final_output(req)

    def _text(self, req: RequestState, index: int) -> str:
        """A finished sample's whole text."""
        seq, state = req.seqs[index], req.text[index]
        if state is not None and state.text_end is not None:
            return state.detok.text[:state.text_end]
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)

    def _completion(self, req: RequestState, index: int, text: str, token_ids: list[int],
                    logprobs_from: int) -> CompletionOutput:
        seq = req.seqs[index]
        out = CompletionOutput(index=index, text=text, token_ids=token_ids,
                               finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        if req.params.logprobs is not None:
            out.logprobs = self._format_logprobs(seq, logprobs_from)
            out.cumulative_logprob = seq.cumulative_logprob
        return out

    def _final_output(self, req: RequestState) -> RequestOutput:
        outputs = [self._completion(req, i, self._text(req, i), seq.output_token_ids, 0)
                   for i, seq in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished=True)

    def _delta_output(self, req: RequestState) -> RequestOutput:
        outputs = []
        for i, (seq, state) in enumerate(zip(req.seqs, req.text)):
            if seq.is_finished:
                text = self._text(req, i)
            else:  # hold back what could still turn out to be the start of a stop string
                hold = max((len(s) for s in req.params.stop), default=1) - 1
                text = state.detok.text[:max(state.sent_chars, len(state.detok.text) - hold)]
            ids = seq.output_token_ids[state.sent_tokens:]
            if not ids and len(text) == state.sent_chars and (state.sent_final or not seq.is_finished):
                continue
            outputs.append(self._completion(req, i, text[state.sent_chars:], ids, state.sent_tokens))
            state.sent_chars, state.sent_tokens = len(text), seq.num_output_tokens
            state.sent_final = seq.is_finished
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs,
                             finished=req.finished)

    def _format_logprobs(self, seq: Sequence, start: int) -> list[dict[int, Logprob]]:
        """vLLM's shape: per generated token, {token id: Logprob} with the top-N and the
        sampled token."""
        result = []
        for token, lp in zip(seq.output_token_ids[start:], seq.logprobs[start:]):
            entry = {tid: Logprob(val, rank) for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1)}
            entry.setdefault(token, Logprob(lp.logprob, lp.rank))
            ids = list(entry)
            for tid, piece in zip(ids, self.tokenizer.convert_ids_to_tokens(ids)):
                entry[tid].decoded_token = piece
            result.append(entry)
        return result


def _find_stop(text: str, num_new: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newest num_new characters."""
    best = None
    for stop in stops:
        pos = text.find(stop, max(0, len(text) - num_new - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
