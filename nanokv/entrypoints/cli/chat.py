"""`nanokv chat` and `nanokv complete`: a terminal chat and a terminal completer, like
`vllm chat` / `vllm complete`, on a model loaded here (LLM.stream) or, with --url, on a
running nanokv or vLLM server (its OpenAI API, streamed over SSE with the standard
library alone).

The answer is printed piece by piece as it is generated. Ctrl-C during an answer stops
that answer (the request is aborted; what was printed stays in the conversation, as the
user saw it) and returns to the prompt. With a local model the first Ctrl-C only sets a
flag that the loop reads between pieces, so the engine is never interrupted inside a
step; a second one during the same answer leaves the program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nanokv.entrypoints.cli.arguments import engine_args_from_cli, sampling_params_from_args
from nanokv.entrypoints.cli.common import EXIT_INTERRUPTED, EXIT_OK, InputError, Rank
from nanokv.sampling_params import SamplingParams

PROMPT = "> "
RESET, EXIT = "/reset", "/exit"
HTTP_TIMEOUT_S = 600.0  # the longest a server may stay silent (connect, or between two streamed events)


@dataclass
class Answer:
    text: str
    stopped: bool  # Ctrl-C ended it early
    seconds: float
    first_piece_s: float | None  # time to the first printed text
    tokens: int | None  # generated tokens, when known


class LocalModel:
    """The model loaded here: chat turns go through its chat template, and LLM.stream
    generates (the request is aborted when the stream is closed early)."""

    interrupt_safely = True  # the engine must not be interrupted inside a step

    def __init__(self, args):
        from nanokv.llm import LLM

        sampling_params_from_args(args)  # the flags checked before the model loads
        engine_args = engine_args_from_cli(args, Rank())
        try:
            self.llm = LLM(**dataclasses.asdict(engine_args))
        except ValueError as e:  # a bad engine flag or model
            raise InputError(str(e)) from None
        # flags not given take the model's generation config, as `nanokv generate` does
        self.params = sampling_params_from_args(args, self.llm.llm_engine.config.default_sampling_params)
        self.name = engine_args.model

    def chat(self, messages: list[dict]) -> Iterator[str]:
        from nanokv.llm import render_chat

        return self.llm.stream(render_chat(self.llm.get_tokenizer(), messages), self.params)

    def complete(self, prompt: str) -> Iterator[str]:
        return self.llm.stream(prompt, self.params)

    def count_tokens(self, text: str) -> int | None:
        return len(self.llm.get_tokenizer()(text, add_special_tokens=False).input_ids)


class RemoteModel:
    """A running OpenAI-compatible server (nanokv serve, vllm serve): /v1/chat/completions
    and /v1/completions with stream=True, read event by event."""

    interrupt_safely = False  # a blocked read must give way to Ctrl-C at once; closing the stream aborts

    def __init__(self, args):
        self.base = args.url.rstrip("/")
        self.api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
        if args.model_name is not None and args.model_tag is not None and args.model_name != args.model_tag:
            raise InputError(f"the model is given twice, as {args.model_tag!r} and --model-name "
                             f"{args.model_name!r}; give it once")
        self.name = args.model_name or args.model_tag or self._first_model()
        self.body = _request_fields(sampling_params_from_args(args))
        self.last_usage: dict | None = None

    def chat(self, messages: list[dict]) -> Iterator[str]:
        for event in self._stream("/chat/completions", {"messages": messages}):
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    yield choice["delta"]["content"]

    def complete(self, prompt: str) -> Iterator[str]:
        for event in self._stream("/completions", {"prompt": prompt}):
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    yield choice["text"]

    def count_tokens(self, text: str) -> int | None:
        return (self.last_usage or {}).get("completion_tokens")

    def _first_model(self) -> str:
        with self._open("/models", None) as response:
            models = json.load(response).get("data") or []
        if not models:
            raise InputError(f"{self.base}/models lists no model; name one with --model-name")
        return models[0]["id"]

    def _stream(self, path: str, fields: dict) -> Iterator[dict]:
        body = {"model": self.name, **self.body, **fields, "stream": True,
                "stream_options": {"include_usage": True}}
        self.last_usage = None
        with self._open(path, body) as response:
            for raw in response:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(_error_message(event))
                self.last_usage = event.get("usage") or self.last_usage
                yield event

    def _open(self, path: str, body: dict | None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            try:
                detail = _error_message(json.loads(e.read()))
            except (ValueError, OSError):
                detail = e.reason
            raise InputError(f"{self.base}{path}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise InputError(f"cannot reach {self.base}{path}: {e.reason}") from None


def _error_message(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body)


def _request_fields(params: SamplingParams) -> dict:
    """The sampling flags as OpenAI request fields (vLLM's extras such as top_k too):
    only those that differ from SamplingParams' defaults, so a plain OpenAI server works."""
    default, fields = SamplingParams(), {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos",
                 "stop", "stop_token_ids", "include_stop_str_in_output", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "skip_special_tokens"):
        value = getattr(params, name)
        if name == "max_tokens" or value != getattr(default, name):
            fields[name] = value
    if fields["max_tokens"] is None:
        del fields["max_tokens"]  # the server's default: what max_model_len leaves
    return fields


def _backend(args) -> LocalModel | RemoteModel:
    return LocalModel(args) if args.url is None else RemoteModel(args)


class _CtrlC:
    """SIGINT while an answer streams. safe=True: the first one sets `pressed` (read
    between pieces), a second raises KeyboardInterrupt; safe=False: it raises at once."""

    def __init__(self, safe: bool):
        self.safe, self.pressed, self._previous = safe, False, None

    def __enter__(self) -> "_CtrlC":
        if self.safe:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.safe:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True


def stream_answer(pieces: Callable[[], Iterator[str]], backend, out=None) -> Answer:
    """Print the pieces as they come; stop early on Ctrl-C. ValueError, RuntimeError
    (a refused request) and InputError (a server's error) propagate."""
    out = out or sys.stdout
    text, start, first = [], time.monotonic(), None
    stopped = False
    with _CtrlC(backend.interrupt_safely) as ctrl_c:
        stream = pieces()
        try:
            for piece in stream:
                if first is None:
                    first = time.monotonic() - start
                text.append(piece)
                out.write(piece)
                out.flush()
                if ctrl_c.pressed:
                    stopped = True
                    break
        except KeyboardInterrupt:
            if ctrl_c.safe:
                raise  # the second Ctrl-C: leave
            stopped = True
        finally:
            stream.close()  # aborts the request if it did not finish
    out.write("\n")
    out.flush()
    answer = "".join(text)
    return Answer(answer, stopped, time.monotonic() - start, first, backend.count_tokens(answer))


def _print_stats(answer: Answer) -> None:
    if answer.first_piece_s is None or answer.seconds <= 0:
        return
    print(f"TTFT: {answer.first_piece_s * 1000:.2f} ms")
    if answer.tokens is not None:
        print(f"TPS:  {answer.tokens / answer.seconds:.2f} tokens/s ({answer.tokens} tokens in "
              f"{answer.seconds:.2f}s)")


def _lines(interactive: bool) -> Iterator[str]:
    """Lines typed (or piped) until EOF; Ctrl-C at the prompt clears the line."""
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
    while True:
        try:
            yield input(PROMPT if interactive else "")
        except EOFError:
            if interactive:
                print()
            return
        except KeyboardInterrupt:
            print(f"\n(Ctrl-D or {EXIT} leaves)")


def _run_turn(backend, pieces: Callable[[], Iterator[str]], stats: bool, hint: str = "") -> Answer | None:
    """One answer; a refused request prints why (and the hint) and gives None."""
    try:
        answer = stream_answer(pieces, backend)
    except (ValueError, RuntimeError, OSError) as e:  # InputError is a ValueError; OSError: a lost server
        print(f"error: {e}{hint}", file=sys.stderr, flush=True)
        return None
    if answer.stopped:
        print("(stopped)", flush=True)
    if stats:
        _print_stats(answer)
    return answer


def chat(args) -> int:
    backend = _backend(args)
    start = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    if args.quick is not None:
        messages = [*start, {"role": "user", "content": args.quick}]
        return _quick(backend, lambda: backend.chat(messages), args.stats)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {backend.name}. {RESET} starts a new conversation, {EXIT} or Ctrl-D leaves, "
              "Ctrl-C stops an answer.", flush=True)
    conversation = list(start)
    for line in _lines(interactive):
        command = line.strip()
        if command == EXIT:
            break
        if command == RESET:
            conversation = list(start)
            print("(new conversation)", flush=True)
            continue
        if not command:
            continue
        conversation.append({"role": "user", "content": line})
        answer = _run_turn(backend, lambda: backend.chat(conversation), args.stats,
                           hint=f" ({RESET} starts a new conversation)" if len(conversation) > len(start) + 1 else "")
        if answer is None:
            conversation.pop()  # the refused turn is not kept
        else:
            conversation.append({"role": "assistant", "content": answer.text})
    return EXIT_OK


def complete(args) -> int:
    backend = _backend(args)
    if args.quick is not None:
        return _quick(backend, lambda: backend.complete(args.quick), args.stats)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Completing with {backend.name}: each line is a prompt. Ctrl-D leaves, Ctrl-C stops a "
              "completion.", flush=True)
    for line in _lines(interactive):
        if line.strip():
            _run_turn(backend, lambda: backend.complete(line), args.stats)
    return EXIT_OK


def _quick(backend, pieces: Callable[[], Iterator[str]], stats: bool) -> int:
    """-q: one answer, then the exit code (130 when Ctrl-C stopped it)."""
    try:
        answer = stream_answer(pieces, backend)
    except (ValueError, RuntimeError) as e:
        raise InputError(str(e)) from None
    if stats:
        _print_stats(answer)
    return EXIT_INTERRUPTED if answer.stopped else EXIT_OK
