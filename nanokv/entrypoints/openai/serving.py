"""/v1/completions and /v1/chat/completions: a validated request becomes engine requests
on the AsyncLLM; their outputs become OpenAI's response, or SSE chunks when streamed.
/tokenize and /detokenize answer from the tokenizer alone.

A streamed request gets the engine's deltas (whose concatenation is the whole text, the
output processor's rule); a non-streamed one asks the engine for its finished output only,
so the engine does no per-step text work for it. The stream of a request is closed (its
unfinished requests aborted) whenever the HTTP request ends: finished, failed,
cancelled, or disconnected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from nanokv.async_llm import AsyncLLM, QueueFullError, RequestAbortedError, RequestStream
from nanokv.engine.types import EngineDeadError
from nanokv.entrypoints.openai.protocol import (
    APIError, GenerationRequest, Limits, bad_request, error_body, param_of, parse_chat, parse_completion,
    parse_detokenize, parse_tokenize, rename_fields)
from nanokv.entrypoints.openai.settings import ServerSettings
from nanokv.llm_engine import check_text
from nanokv.output_processor import RequestState
from nanokv.outputs import CompletionOutput, Logprob
from nanokv.tool_calls import ToolStream, read_answer

logger = logging.getLogger("nanokv")

_LOGPROB_FLOOR = -9999.0  # what -inf becomes in JSON (vLLM's choice)


def dumps(obj) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate cannot be UTF-8: escape everything
        return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("ascii")


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


def _sse(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class TokenText:
    """A token id's own text (special tokens kept), as vLLM reports tokens in logprobs."""

    def __init__(self, tokenizer):
        self._decode = tokenizer.decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode([token_id], skip_special_tokens=False)
        return text


def _logprob(value: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(value) or value < _LOGPROB_FLOOR else float(value)


@dataclass
class _Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    # prompt tokens found in the prefix cache, per request (--enable-prompt-tokens-details); None: not reported
    cached_tokens: dict[str, int] | None = None

    def as_dict(self) -> dict:
        details = None if self.cached_tokens is None else {"cached_tokens": sum(self.cached_tokens.values())}
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens, "prompt_tokens_details": details}

    def note(self, out) -> None:
        """Take a request's cached-token count from its latest output."""
        if self.cached_tokens is not None:
            self.cached_tokens[out.request_id] = out.num_cached_tokens


@dataclass
class _Choice:
    """One sample's deltas, put together (non-streamed answers)."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.texts.append(c.text)
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def token_id_name(token_id: int) -> str:
    """A token as --return-tokens-as-token-ids names it in logprobs (vLLM's form)."""
    return f"token_id:{token_id}"


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, settings: ServerSettings):
        self.llm = llm
        self.settings = settings
        self.max_response_tokens = settings.max_response_tokens
        self.enable_prompt_tokens_details = settings.enable_prompt_tokens_details
        self.token_text = TokenText(llm.tokenizer)
        self.limits = Limits.of(llm.tokenizer, llm.config.max_model_len)
        self.sampling_defaults = llm.config.default_sampling_params  # for the fields a request leaves unset
        if self.sampling_defaults:
            logger.info("Using default sampling params from model generation config: %s", self.sampling_defaults)

    # ---- the tokenizer alone -------------------------------------------------------------------
    def tokenize(self, body: dict) -> dict:
        """vLLM's TokenizeResponse: count, max_model_len, tokens, token_strs (null unless asked)."""
        tokenizer = self.llm.tokenizer
        req = parse_tokenize(body, self.settings, tokenizer, self.limits)
        self._log_request(f"tokn-{uuid.uuid4().hex}", req.prompt, req.token_ids, None)
        strs = tokenizer.convert_ids_to_tokens(req.token_ids) if req.token_strs else None
        return {"count": len(req.token_ids), "max_model_len": self.llm.config.max_model_len,
                "tokens": req.token_ids, "token_strs": strs}

    def detokenize(self, body: dict) -> dict:
        tokenizer = self.llm.tokenizer
        req = parse_detokenize(body, self.settings, len(tokenizer))
        self._log_request(f"tokn-{uuid.uuid4().hex}", None, req.token_ids, None)
        return {"prompt": tokenizer.decode(req.token_ids)}

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's init arguments (file paths left out), its
        class, and the server's chat template when --chat-template set one."""
        tokenizer = self.llm.tokenizer
        info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                if not k.endswith("_file") and k != "name_or_path"}
        info["tokenizer_class"] = type(tokenizer).__name__
        if self.settings.chat_template is not None:
            info["chat_template"] = self.settings.chat_template
        return info

    def _log_request(self, request_id: str, prompt: str | None, token_ids: list[int] | None, params) -> None:
        """--enable-log-requests: vLLM's INFO line, prompt and ids cut to --max-log-len."""
        if not self.settings.log_requests:
            return
        cut = self.settings.max_log_len
        if cut is not None:
            prompt = None if prompt is None else prompt[:cut]
            token_ids = None if token_ids is None else token_ids[:cut]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s.", request_id, prompt,
                    params, token_ids)

    async def completions(self, body: dict, request: Request, *, offload: bool = False) -> Response:
        """offload: validate and tokenize in a worker thread (a big body must not stall
        the event loop; the tokenizer and make_request are safe there)."""
        return await self._serve(body, False, request, offload)

    async def chat(self, body: dict, request: Request, *, offload: bool = False) -> Response:
        return await self._serve(body, True, request, offload)

    # ---- the request -------------------------------------------------------------------------
    async def _serve(self, body: dict, chat: bool, request: Request, offload: bool) -> Response:
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if offload:
                gen, reqs = await asyncio.to_thread(self._prepare, body, chat, response_id)
            else:
                gen, reqs = self._prepare(body, chat, response_id)
            stream = self.llm.add(reqs)
        except QueueFullError as e:
            raise APIError(503, str(e), headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not running: {e}") from None
        except RequestAbortedError as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        answer = _Answer(self, gen, chat, response_id, reqs, self.llm.tokenizer)
        if gen.stream:
            return _EventStream(answer.events(stream), stream.close)
        try:
            outputs = await _unless_disconnected(_gather(stream), request)
        except EngineDeadError as e:
            raise APIError(503, f"the engine stopped: {e}") from None
        except RequestAbortedError as e:
            raise APIError(503, f"the request was aborted: {e}") from None
        finally:
            stream.close()
        if outputs is None:  # the client went away; its requests are aborted
            return Response(status_code=499)
        return json_response(answer.result(outputs))

    def _prepare(self, body: dict, chat: bool, response_id: str) -> tuple[GenerationRequest, list[RequestState]]:
        """The body, validated, as engine requests (nothing queued yet)."""
        gen = (parse_chat(body, self.settings, self.llm.tokenizer, self.limits, self.sampling_defaults) if chat
               else parse_completion(body, self.settings, self.limits, self.sampling_defaults))
        self.llm.check_room(len(gen.prompts) * gen.params.n)  # before tokenizing a big batch
        reqs = self._make_requests(gen, response_id)
        for req in reqs:
            self._log_request(req.request_id, req.prompt, req.prompt_token_ids, gen.params)
        if not gen.stream:
            self._check_response_size(gen, reqs)
        return gen, reqs

    def _check_response_size(self, gen: GenerationRequest, reqs: list[RequestState]) -> None:
        """A 400 for a whole response that could outgrow max_response_tokens: every sample's
        max_tokens (as clamped to max_model_len) times 1 + logprobs."""
        per_token = 1 + (gen.logprobs or 0)
        size = per_token * sum(seq.max_tokens for r in reqs for seq in r.seqs)
        if size <= self.max_response_tokens:
            return
        name = gen.param_names["max_tokens"]
        most = max(seq.max_tokens for r in reqs for seq in r.seqs)
        prompts = f"{len(reqs)} prompts x " if len(reqs) > 1 else ""
        raise bad_request(
            f"this response could hold {size} tokens and logprobs ({prompts}n={gen.params.n} x up to {most} "
            f"tokens x (1 + logprobs {gen.logprobs or 0})), more than the {self.max_response_tokens} a "
            f"non-streamed response may hold (--max-response-tokens); lower n, {name} or logprobs, or send "
            "stream: true (a stream holds one step at a time)", name)

    def _make_requests(self, gen: GenerationRequest, response_id: str) -> list[RequestState]:
        reqs = []
        for i, prompt in enumerate(gen.prompts):
            try:
                if isinstance(prompt, str) and not gen.add_special_tokens:
                    check_text(prompt, "prompt")
                    ids = self.llm.tokenizer(prompt, add_special_tokens=False).input_ids
                    prompt = {"prompt": prompt, "prompt_token_ids": ids}
                reqs.append(self.llm.make_request(prompt, gen.params, f"{response_id}-{i}", stream=gen.stream))
            except ValueError as e:
                message = rename_fields(str(e), gen.param_names)
                param = param_of(message, gen.param_names)
                raise bad_request(f"prompt {i}: {message}" if len(gen.prompts) > 1 else message, param) from None
        return reqs


def _plain(value):
    """A tokenizer setting as JSON: an added token as its text, anything else unknown as str."""
    if hasattr(value, "content"):  # AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


async def _gather(stream: RequestStream) -> list:
    outputs = []
    while batch := await stream.next_outputs():
        outputs += batch
    return outputs


async def _unless_disconnected(work, request: Request):
    """Await work; None (and work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        task.cancel()
        watch.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _engine_failure(response_id: str, reason: str) -> APIError:
    """A 500 for a request that failed in a step: the reason (exception text) goes to the
    log, the client gets the response id to find it there."""
    logger.error("%s: %s", response_id, reason)
    return APIError(500, f"the request failed inside the server; its log has the details under {response_id}")


class _EventStream(StreamingResponse):
    """An SSE response that closes its request stream however the response ends (a
    client that disconnects cancels it before or while the body is sent)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Answer:
    """OpenAI's response shapes for one request's deltas: completions or chat, whole or
    streamed. Choice index = prompt index * n + sample index."""

    def __init__(self, serving: OpenAIServing, gen: GenerationRequest, chat: bool, response_id: str,
                 reqs: list[RequestState], tokenizer):
        self.gen, self.chat, self.id = gen, chat, response_id
        self.token_text = serving.token_text
        # how logprobs name a token: its text, or "token_id:N"
        self.token_name = token_id_name if gen.tokens_as_ids else serving.token_text
        self.created = int(time.time())
        n = gen.params.n
        self.base = {r.request_id: i * n for i, r in enumerate(reqs)}
        self.num_choices = len(reqs) * n
        self.usage = _Usage(sum(len(r.prompt_token_ids) for r in reqs),
                            cached_tokens={} if serving.enable_prompt_tokens_details else None)
        self.prompt_ids = [r.prompt_token_ids for r in reqs]  # return_token_ids
        self.sent_prompt_ids: set[int] = set()  # streamed completions: choices that had their prompt's ids
        self.echo = [""] * len(reqs)  # per prompt: the text put before each of its answers (vLLM's echo)
        if gen.echo:
            self.echo = [gen.echo_text if chat else r.prompt if isinstance(r.prompt, str)
                         else tokenizer.decode(r.prompt_token_ids) for r in reqs]
        # completions' echo with logprobs: the prompt's logprobs come first (they arrive with
        # the request's first output, so a streamed echo waits for it)
        self.echo_logprobs = gen.echo and not chat and gen.logprobs is not None
        self.prompt_logprobs: list[list | None] = [None] * len(reqs)  # per prompt, once it came
        tools = gen.tools if chat else None  # how answers are read for tool calls (None: text)
        self.tools = tools
        self.tool_streams = None if tools is None or not gen.stream else \
            [ToolStream(tools.choice, tools.parser, tools.parallel) for _ in range(self.num_choices)]

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.gen.model,
                "system_fingerprint": None, "choices": choices}

    # ---- whole -----------------------------------------------------------------------------------
    def result(self, outputs: list) -> dict:
        choices = [_Choice() for _ in range(self.num_choices)]
        for out in outputs:
            if out.error is not None:
                raise _engine_failure(self.id, out.error)
            self.usage.note(out)
            self._note_prompt_logprobs(out)
            for c in out.outputs:
                choices[self.base[out.request_id] + c.index].add(self._scored(c))
        self.usage.completion_tokens = sum(len(ch.token_ids) for ch in choices)
        body = self._envelope("chat.completion" if self.chat else "text_completion",
                              [self._whole_choice(i, ch) for i, ch in enumerate(choices)])
        body["usage"] = self.usage.as_dict()
        if self.chat and self.gen.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids[0]
        if self.chat and self.gen.params.prompt_logprobs is not None:  # vLLM's place: the top level
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.prompt_logprobs[0])
        return body

    def _note_prompt_logprobs(self, out) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[self.base[out.request_id] // self.gen.params.n] = out.prompt_logprobs

    def _scored(self, c: CompletionOutput) -> CompletionOutput:
        """A score-only answer (echo, max_tokens=0) leaves out the one token generated."""
        if not self.gen.score_only:
            return c
        return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])

    def _prompt_part(self, index: int) -> tuple[list[int], list]:
        """The echoed prompt's token ids and logprob entries (None first) for choice index."""
        prompt = index // self.gen.params.n
        return self.prompt_ids[prompt], self.prompt_logprobs[prompt] or []

    def _whole_choice(self, index: int, ch: _Choice) -> dict:
        text = self.echo[index // self.gen.params.n] + "".join(ch.texts)
        logprobs = None
        if self.gen.logprobs is not None:
            if self.chat:
                logprobs = self._chat_logprobs(ch.token_ids, ch.logprobs)
            elif self.echo_logprobs:
                ids, entries = self._prompt_part(index)
                logprobs = self._completion_logprobs(ids + ch.token_ids, entries + ch.logprobs, 0)[0]
            else:
                logprobs = self._completion_logprobs(ch.token_ids, ch.logprobs, 0)[0]
        if not self.chat and self.gen.params.prompt_logprobs is not None:
            choice_prompt_logprobs = _vllm_prompt_logprobs(self.prompt_logprobs[index // self.gen.params.n])
        else:
            choice_prompt_logprobs = None
        if self.chat:
            message, finish_reason = {"role": self.gen.role, "content": text, "tool_calls": []}, ch.finish_reason
            if self.tools is not None:
                t = self.tools
                answer = read_answer(text, ch.finish_reason, t.choice, t.parser, t.parallel)
                message["content"], finish_reason = answer.content, answer.finish_reason
                message["tool_calls"] = [call.as_dict() for call in answer.calls]
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": ch.stop_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": ch.finish_reason,
                      "stop_reason": ch.stop_reason}
            if choice_prompt_logprobs is not None:  # vLLM's place for completions: each choice
                choice["prompt_logprobs"] = choice_prompt_logprobs
        return self._with_token_ids(choice, index, ch.token_ids)

    def _with_token_ids(self, choice: dict, index: int, token_ids: list[int]) -> dict:
        """return_token_ids (vLLM's): the choice's new token ids; a completion's choice also
        its prompt's ids (streamed: on the choice's first chunk only)."""
        if self.gen.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if not self.chat and index not in self.sent_prompt_ids:
                choice["prompt_token_ids"] = self.prompt_ids[index // self.gen.params.n]
                if self.gen.stream:
                    self.sent_prompt_ids.add(index)
        return choice

    # ---- streamed ------------------------------------------------------------------------------
    async def events(self, stream: RequestStream):
        gen = self.gen
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        offsets = [0] * self.num_choices  # completions logprobs: text offset of each choice

        def chunk(choices: list, **extra) -> bytes:
            body = {**self._envelope(obj, choices), **extra}
            if gen.include_usage:
                body["usage"] = self.usage.as_dict() if gen.continuous_usage else None
            return _sse(body)

        try:
            if self.chat:  # the role first, one chunk per choice (as OpenAI and vLLM do)
                # return_token_ids: the prompt's ids on the first chunk (vLLM's place)
                ids = {"prompt_token_ids": self.prompt_ids[0]} if gen.return_token_ids else {}
                yield b"".join(chunk([{"index": i, "delta": {"role": gen.role, "content": ""},
                                       "logprobs": None, "finish_reason": None}], **(ids if i == 0 else {}))
                               for i in range(self.num_choices))
            if gen.echo and not self.echo_logprobs:  # the echoed text first, one chunk per choice
                yield b"".join(chunk([self._echo_choice(i)]) for i in range(self.num_choices)
                               if self.echo[i // gen.params.n])
            while outputs := await stream.next_outputs():
                parts = []
                for out in outputs:
                    if out.error is not None:
                        yield _sse(_engine_failure(self.id, out.error).body()) + _DONE
                        return
                    self.usage.note(out)
                    if self.echo_logprobs and out.prompt_logprobs is not None:  # the echo, with its logprobs
                        self._note_prompt_logprobs(out)
                        base = self.base[out.request_id]
                        parts += [chunk([self._echo_choice(i, offsets)]) for i in range(base, base + gen.params.n)]
                    for c in map(self._scored, out.outputs):
                        index = self.base[out.request_id] + c.index
                        self.usage.completion_tokens += len(c.token_ids)
                        with_logprobs = gen.logprobs is not None and bool(c.token_ids)
                        with_ids = gen.return_token_ids and bool(c.token_ids)
                        if self.tool_streams is not None:  # text held back, calls sent whole at the end
                            c, calls = self._tool_delta(index, c)
                            parts += [chunk([{"index": index, "delta": {"tool_calls": [d]}, "logprobs": None,
                                              "finish_reason": None}]) for d in calls]
                        if not c.text and c.finish_reason is None and not with_logprobs and not with_ids:
                            continue  # nothing to show yet (held back for a stop string, a partial character)
                        parts.append(chunk([self._delta_choice(index, c, offsets, with_logprobs)]))
                if parts:
                    yield b"".join(parts)
        except EngineDeadError as e:
            yield _sse(error_body(503, f"the engine stopped: {e}")) + _DONE
            return
        except RequestAbortedError as e:
            yield _sse(error_body(503, f"the request was aborted: {e}")) + _DONE
            return
        if gen.include_usage:
            body = self._envelope(obj, [])
            body["usage"] = self.usage.as_dict()
            yield _sse(body)
        yield _DONE

    def _tool_delta(self, index: int, c: CompletionOutput) -> tuple[CompletionOutput, list[dict]]:
        """A streamed chat delta with tools: the content that may be sent now, and at the
        end the calls as OpenAI streams them (per call: index, id, type, name and empty
        arguments, then the arguments whole), with the answer's finish reason."""
        ts = self.tool_streams[index]
        text = ts.feed(c.text)
        if c.finish_reason is None:
            return dataclasses.replace(c, text=text), []
        rest, answer = ts.finish(c.finish_reason)
        deltas = []
        for i, call in enumerate(answer.calls):
            deltas.append({"index": i, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return dataclasses.replace(c, text=text + rest, finish_reason=answer.finish_reason), deltas

    def _echo_choice(self, index: int, offsets: list[int] | None = None) -> dict:
        text = self.echo[index // self.gen.params.n]
        if self.chat:
            return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        logprobs = None
        if offsets is not None:
            logprobs, offsets[index] = self._completion_logprobs(*self._prompt_part(index), 0)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _delta_choice(self, index: int, c: CompletionOutput, offsets: list[int], with_logprobs: bool) -> dict:
        logprobs = None
        if with_logprobs:
            if self.chat:
                logprobs = self._chat_logprobs(c.token_ids, c.logprobs or [])
            else:
                logprobs, offsets[index] = self._completion_logprobs(c.token_ids, c.logprobs or [], offsets[index])
        if self.chat:
            delta = {"content": c.text} if c.text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
        else:
            choice = {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
        return self._with_token_ids(choice, index, c.token_ids)

    # ---- logprobs --------------------------------------------------------------------------------
    def _completion_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]],
                             offset: int) -> tuple[dict, int]:
        """The legacy shape: tokens, token_logprobs, top_logprobs (top N and the sampled
        token, so up to N + 1 entries, keyed by their name), text_offset (into the text)."""
        name = self.token_name
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            tokens.append(name(token_id))
            offsets.append(offset)
            offset += len(self.token_text(token_id))
            if entry is None:  # a prompt's first token: nothing before it to score it
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_logprob(entry[token_id].logprob))
            top: dict[str, float] = {}
            for t, lp in entry.items():  # two tokens with one text (partial characters): keep the likelier
                key, value = name(t), _logprob(lp.logprob)
                if value > top.get(key, -math.inf):
                    top[key] = value
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}, offset

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> dict:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs": [the top N by rank]}]}."""
        name, top_n = self.token_name, self.gen.logprobs

        def item(token_id: int, lp: Logprob) -> dict:
            token = name(token_id)
            return {"token": token, "logprob": _logprob(lp.logprob), "bytes": list(token.encode("utf-8"))}

        content = []
        for token_id, entry in zip(token_ids, entries):
            top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
                         key=lambda x: x[1].rank)
            content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in top]})
        return {"content": content}


def _vllm_prompt_logprobs(entries: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's responses carry it: per prompt token, null
    (the first) or {token id: {"logprob", "rank", "decoded_token"}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]
