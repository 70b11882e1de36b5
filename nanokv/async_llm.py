"""AsyncLLM: the LLMEngine behind an asyncio front (what the server runs on).

The engine is not thread-safe, so one engine thread owns it: every LLMEngine call that
changes or reads its state happens there. The thread steps while work exists and waits
on a condition otherwise (no polling). Coroutines validate their requests themselves
(make_request: a ValueError comes back at once and nothing is queued) and hand them over
through a lock-guarded command list; the outputs of each step go back to the event loop
in one call_soon_threadsafe, which feeds each request's RequestStream. A consumer that
goes away (a client that disconnects) closes its stream, which aborts its requests: the
engine thread frees their KV blocks before its next step.

Failures: a request that fails inside a step fails alone (the engine's own rule: its
stream ends with RequestOutput.error); an unexpected error of a whole step fails the
requests in the engine at the time and the loop goes on; EngineDeadError (a dead
tensor-parallel worker, a closed engine) fails every request and stops the loop, after
which is_alive is False and new requests raise EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable

from nanokv.engine.arg_utils import EngineArgs
from nanokv.engine.types import EngineDeadError
from nanokv.llm_engine import LLMEngine, PromptType, check_vllm_extras
from nanokv.metrics import EngineSnapshot
from nanokv.output_processor import RequestState, accumulate
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("nanokv")


class QueueFullError(RuntimeError):
    """More sequences wait for admission than max_waiting allows; retry later."""


class RequestAbortedError(RuntimeError):
    """The request was aborted for the server's sake (it is shutting down)."""


__all__ = ["AsyncLLM", "EngineSnapshot", "QueueFullError", "RequestAbortedError", "RequestStream"]


class RequestStream:
    """The outputs of the requests added together (a completions call with several
    prompts adds several), deltas in arrival order. Owned by the event loop.

    next_outputs() waits for what has arrived and returns it ([] once every request has
    finished); close() aborts the unfinished ones (also on leaving `async with`)."""

    def __init__(self, llm: "AsyncLLM", requests: list[RequestState]):
        self._llm = llm
        self.request_ids = [r.request_id for r in requests]
        self._unfinished = set(self.request_ids)
        self._items: list[RequestOutput] = []
        self._ready = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def next_outputs(self) -> list[RequestOutput]:
        while not self._items:
            if self._error is not None:
                raise self._error
            if not self._unfinished:
                return []
            self._ready.clear()
            await self._ready.wait()
        items, self._items = self._items, []
        return items

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while outputs := await self.next_outputs():
            for out in outputs:
                yield out

    def close(self) -> None:
        """Abort the requests that have not finished (idempotent)."""
        if self._unfinished:
            ids, self._unfinished = list(self._unfinished), set()
            self._llm.abort(ids)
        self._ready.set()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # ---- fed by AsyncLLM on the event loop ------------------------------------------------
    def _push(self, out: RequestOutput) -> None:
        if out.finished:
            self._unfinished.discard(out.request_id)
        self._items.append(out)
        self._ready.set()

    def _aborted(self, request_id: str) -> None:
        """AsyncLLM.abort dropped the request: it gets nothing more, and the stream ends
        once the others have."""
        self._unfinished.discard(request_id)
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._unfinished = set()
        self._ready.set()


class AsyncLLM:
    """An LLMEngine driven by a background thread, for asyncio callers.

    >>> llm = AsyncLLM.from_engine_args(EngineArgs(model="path/to/model"))
    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
    ...     print(out.outputs[0].text)  # the text so far

    max_waiting: the most sequences queued for admission (waiting in the scheduler or
    handed over); add() beyond it raises QueueFullError. None: no bound.
    The engine records the metrics itself (engine.metrics, nanokv.metrics).
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None):
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 1):
            raise ValueError(f"max_waiting must be an int >= 1 or None, got {max_waiting!r}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        # Requests are tokenized in the callers' threads while the engine thread decodes:
        # read-only use of a fast tokenizer is thread-safe, but its first encode may reset
        # truncation or padding set by tokenizer.json (a write): do that once, here.
        engine.tokenizer("warm up")
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._commands: list[tuple[str, object]] = []  # guarded by _cond
        self._num_handed = 0  # sequences handed over, not yet in the scheduler (guarded by _cond)
        self._num_engine_waiting = 0  # the scheduler's waiting queue, as of the last step
        self._stopping = False
        self._draining = False  # shutting down: no new requests
        self._dead: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # request id -> stream; event loop only
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        # CUDA's current device is per thread: the engine thread takes the one the engine
        # was built under (kernels launch on the current device)
        self._cuda_device = _current_cuda_device(engine.config.device)
        # engine thread only
        self._sink: list[RequestOutput] = []  # every request's outputs land here
        self._live: set[str] = set()  # requests in the engine

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers=None, **kwargs) -> "AsyncLLM":
        """An AsyncLLM over a new engine (kwargs: max_waiting). vLLM's start_engine_loop
        and usage_context have no effect (the loop starts with the first request)."""
        if stat_loggers is not None:
            raise ValueError("stat_loggers (vLLM's logger factories) is not supported; append a callable "
                             "taking an IterationStats to the AsyncLLM's stat_loggers list instead")
        return cls(LLMEngine(args.create_engine_config()), **kwargs)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Bind to the running event loop and start the engine thread (idempotent)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError("this AsyncLLM already serves another event loop")
        self._loop = loop
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nanokv-engine", daemon=True)
            self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # vLLM's engine-client names (vllm.v1.engine.async_llm.AsyncLLM)
    @property
    def model_config(self):
        """vLLM's ModelConfig view of the engine (nanokv.vllm_config)."""
        return self.engine.model_config

    @property
    def vllm_config(self):
        return self.engine.vllm_config

    async def get_model_config(self):
        return self.engine.model_config

    async def get_vllm_config(self):
        return self.engine.vllm_config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)  # nanokv generates text only

    @property
    def errored(self) -> bool:
        """Whether the engine has stopped (failed or shut down); requests then fail."""
        return self._dead is not None

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(self._dead or "the engine is running")

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine has stopped (vLLM's health check)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def drain(self, timeout: float) -> None:
        """Begin a graceful shutdown (on the event loop): refuse new requests, and abort
        those still unfinished after `timeout` seconds (their streams then raise
        RequestAbortedError)."""
        self._draining = True
        asyncio.get_running_loop().call_later(max(timeout, 0.0), self.abort_all, "the server is shutting down")

    def abort_all(self, reason: str) -> None:
        """Abort every request; their streams raise RequestAbortedError(reason)."""
        streams = set(self._streams.values())
        self.abort(list(self._streams))
        for stream in streams:
            stream._fail(RequestAbortedError(reason))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is left, stop the engine thread (a step in progress finishes first),
        then close the engine. Streams still open fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the engine thread did not stop within %s s", timeout)
                return
        if self._dead is None:
            self._dead = "the server is shutting down"
        self._in_loop(self._fail_streams, EngineDeadError(self._dead))
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - closing must not raise at exit
            logger.exception("closing the engine failed")

    # ---- requests (event loop) ---------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None, *, stream: bool = True) -> RequestState:
        """Validate and tokenize one request in the caller (ValueError on bad input); no
        engine state changes. stream=True: its outputs are deltas, one per step that moves
        it; False: one output when it finishes (the engine then does no per-step text work
        for it, and the inter-token latency metric does not see it)."""
        self._check_alive()
        if request_id is None:
            request_id = f"{self._id_prefix}-{next(self._ids)}"
        return self.engine.make_request(prompt, params, request_id, stream=stream)

    def check_room(self, num_seqs: int) -> None:
        """Raise if num_seqs more sequences would exceed max_waiting: ValueError when they
        never can (more than max_waiting on their own), QueueFullError when not now."""
        self._check_alive()
        if self.max_waiting is None:
            return
        if num_seqs > self.max_waiting:
            raise ValueError(f"this request has {num_seqs} sequences (prompts x n), more than the "
                             f"{self.max_waiting} the server queues (--max-waiting); split it or lower n")
        waiting = self._num_handed + self._num_engine_waiting
        if waiting + num_seqs > self.max_waiting:
            raise QueueFullError(f"{waiting} sequences are waiting and the server queues at most "
                                 f"{self.max_waiting} (--max-waiting); retry later")

    def add(self, requests: list[RequestState]) -> RequestStream:
        """Hand validated requests (make_request) to the engine thread; their outputs
        arrive on the returned stream. QueueFullError / EngineDeadError: nothing added."""
        if self._loop is None:
            self.start()
        num_seqs = sum(len(r.seqs) for r in requests)
        stream = RequestStream(self, requests)
        with self._cond:
            self._check_alive()
            if self._stopping or self._draining:
                raise RequestAbortedError("the server is shutting down; retry on another server")
            self.check_room(num_seqs)
            self._num_handed += num_seqs
            self._commands.append(("add", requests))
            self._cond.notify()
        for request_id in stream.request_ids:
            self._streams[request_id] = stream
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request=None, tokenization_kwargs=None,
                       trace_headers=None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield one request's outputs as sampling_params.output_kind asks (vLLM's): each
        step that moves it, CUMULATIVE (the default) the whole output so far, DELTA only
        the new text and token ids of each sample that moved; FINAL_ONLY one output at the
        end. The last has finished=True. Closing the generator early aborts the request
        (Python closes an abandoned one only when it is collected: wrap it in
        contextlib.aclosing to abort at once). A request that fails in the engine raises
        RuntimeError. trace_headers has no effect; lora_request, tokenization_kwargs and a
        priority other than 0 are refused."""
        check_vllm_extras(lora_request, tokenization_kwargs, [priority])
        kind = RequestOutputKind.CUMULATIVE if sampling_params is None else sampling_params.output_kind
        request = self.make_request(prompt, sampling_params, request_id, stream=kind != RequestOutputKind.FINAL_ONLY)
        stream = self.add([request])
        so_far = None
        async with stream:
            async for out in stream:
                if out.error is not None:
                    raise RuntimeError(f"request failed: {out.error}")
                if kind == RequestOutputKind.CUMULATIVE:
                    out = so_far = accumulate(so_far, out)
                yield out

    def abort(self, request_ids: str | list[str]) -> Awaitable[None]:
        """Abort requests, one id or a list (unknown or finished ids are ignored); their
        streams get nothing more (a stream whose requests are all aborted or finished ends)
        and their KV blocks are free before the engine's next step. Done on return; the
        result may be awaited (vLLM's abort is a coroutine: `await engine.abort(id)`)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._aborted(request_id)
        with self._cond:
            if self._dead is None and not self._stopping:
                self._commands.append(("abort", list(request_ids)))
                self._cond.notify()
        return _DONE

    async def snapshot(self) -> EngineSnapshot:
        """The engine's gauges, read by the engine thread between steps."""
        return await self._between_steps(self._snapshot)

    async def reset_prefix_cache(self, device=None) -> bool:
        """vLLM's: forget every cached prefix block, between two steps (device has no
        effect). False, and nothing forgotten, while requests hold KV blocks."""
        return await self._between_steps(self.engine.reset_prefix_cache)

    async def get_tokenizer(self):
        """vLLM's (a coroutine there): the tokenizer."""
        return self.tokenizer

    async def _between_steps(self, fn):
        """fn() called by the engine thread between two steps (here when no thread steps
        the engine, or soon none will); its result."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            if not self.is_alive or self._stopping:
                return fn()
            self._commands.append(("call", (fn, future)))
            self._cond.notify()
        return await future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ---- the event loop side of delivery ----------------------------------------------------
    def _in_loop(self, fn, *args) -> None:
        """Run fn(*args) on the event loop soon (from any thread)."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            stream._push(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_streams(self, error: BaseException) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream._fail(error)

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._cuda_device is not None:
                import torch

                torch.cuda.set_device(self._cuda_device)
            self._serve()
        except EngineDeadError as e:
            logger.error("the engine is dead: %s", e)
            self._die(str(e))
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave clients hanging
            logger.exception("the engine loop stopped")
            # the reason reaches clients (503 bodies, /health): the exception's text stays in the log
            self._die(f"the engine loop stopped on an internal error ({type(e).__name__}); the server's log "
                      "has the traceback")
        finally:  # answer the calls (snapshots, ...) nobody will serve now
            with self._cond:
                self._stopping = True
                commands, self._commands = self._commands, []
            for kind, payload in commands:
                if kind == "call":
                    fn, future = payload
                    self._in_loop(_resolve, future, fn())

    def _serve(self) -> None:
        engine = self.engine
        busy = False
        while True:
            with self._cond:
                while not (self._commands or busy or self._stopping):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            if commands:
                self._apply(commands)
            if stopping:
                self._abort_live()
                return
            if engine.has_unfinished():
                self._step()
            busy = engine.has_unfinished()

    def _apply(self, commands: list[tuple[str, object]]) -> None:
        """Adds, aborts and calls between steps, in the order they were made (an abort
        always comes after its add)."""
        engine, failed = self.engine, []
        for kind, payload in commands:
            if kind == "add":
                for req in payload:
                    try:
                        engine.enqueue(req, self._sink)
                    except EngineDeadError:
                        raise
                    except Exception as e:  # noqa: BLE001 - it fails alone
                        failed.append(_error_output(req.request_id, f"the engine refused the request: {e}"))
                    else:
                        self._live.add(req.request_id)
                with self._cond:  # handed over -> in the scheduler, in one move
                    self._num_handed -= sum(len(req.seqs) for req in payload)
                    self._num_engine_waiting = len(engine.scheduler.waiting)
            elif kind == "abort":
                for request_id in payload:
                    if request_id in self._live:
                        self._live.discard(request_id)
                        engine.abort(request_id)
            else:  # a call between steps
                fn, future = payload
                self._in_loop(_resolve, future, fn())
        self._num_engine_waiting = len(engine.scheduler.waiting)  # aborts shrink it too
        if failed:
            self._in_loop(self._deliver, failed)

    def _step(self) -> None:
        engine, sink = self.engine, self._sink
        try:
            engine.advance()
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - fail what was running, keep serving
            logger.exception("an engine step failed; failing the %d requests in the engine", len(self._live))
            reason = f"the engine failed: {type(e).__name__}: {e}"
            for out in sink:
                if out.finished:
                    self._live.discard(out.request_id)
            sink += [_error_output(request_id, reason) for request_id in self._live]
            self._abort_live()
        self._num_engine_waiting = len(engine.scheduler.waiting)
        if not sink:
            return
        outputs = sink[:]
        sink.clear()
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        self._in_loop(self._deliver, outputs)

    def _abort_live(self) -> None:
        for request_id in list(self._live):
            self.engine.abort(request_id)
        self._live.clear()

    def _snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot(self._num_handed)

    def _die(self, reason: str) -> None:
        self._dead = reason
        self._in_loop(self._fail_streams, EngineDeadError(reason))


def _current_cuda_device(device) -> int | None:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.current_device()


class _Done:
    """Awaitable, with nothing to wait for."""

    __slots__ = ()

    def __await__(self):
        return iter(())


_DONE = _Done()


def _error_output(request_id: str, reason: str) -> RequestOutput:
    return RequestOutput(request_id, None, [], [], finished=True, error=reason)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
