"""`nanokv serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions, POST /v1/chat/completions, GET /v1/models (Bearer-checked
    with --api-key, as vLLM checks /v1 only), POST /tokenize, POST /detokenize,
    GET /health, GET|POST /ping, GET /metrics, GET /version, and FastAPI's /docs,
    /redoc and /openapi.json (unless --disable-fastapi-docs)

The engine runs on an AsyncLLM (one engine thread); this module is the HTTP surface:
body reading, the API key, error objects, and the process's lifecycle (signals,
graceful shutdown). serving.py builds the answers, protocol.py validates the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import sys
import time
import uuid

try:
    import prometheus_client
    import uvicorn
    from fastapi import FastAPI
    from starlette.middleware.cors import CORSMiddleware
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import Response
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"nanokv serve needs {e.name}, which nanokv installs (pip install -e . in the repository, "
                      "or pip install nanokv)") from e

import nanokv
from nanokv.async_llm import AsyncLLM
from nanokv.engine.arg_utils import EngineArgs
from nanokv.entrypoints.openai.connections import connection_limits, guarded_protocol, listen_queue, raise_fd_limit
from nanokv.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from nanokv.entrypoints.openai.protocol import APIError, bad_request, error_body, model_not_found
from nanokv.entrypoints.openai.serving import OpenAIServing, json_response
from nanokv.entrypoints.openai.settings import ServerSettings
from nanokv.entrypoints.openai.sites import SiteGuard
from nanokv.entrypoints.openai.stats_log import StatsLog

logger = logging.getLogger("nanokv")

MAX_BODY_BYTES = 32 * 2**20  # a prompt of max_model_len tokens is far smaller
MAX_DEPTH = 32  # JSON nesting: OpenAI's bodies need 5 levels; deeper ones would strain repr() and friends
OFFLOAD_BYTES = 64 * 2**10  # bodies this big are parsed and tokenized off the event loop


def build_app(llm: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The ASGI app over an AsyncLLM (started in the app's lifespan, shut down after)."""
    if not settings.model_names:  # no --served-model-name: EngineArgs.served_model_name, else the model
        settings = dataclasses.replace(settings, model_names=llm.config.served_model_name or (llm.config.model,))
    prometheus_client.disable_created_metrics()
    metrics = ServerMetrics(llm.engine.metrics, settings.model_names[0])
    serving = OpenAIServing(llm, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        llm.start()
        logger.info("serving %s as %s on %s://%s:%d", llm.config.model, ", ".join(settings.model_names),
                    "https" if settings.ssl_certfile else "http", settings.host, settings.port)
        stats = None
        if not llm.config.disable_log_stats:
            stats = asyncio.ensure_future(StatsLog(llm, settings.log_stats_interval).run())
        yield
        if stats is not None:
            stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stats
        await asyncio.to_thread(llm.shutdown)

    docs = settings.docs
    app = FastAPI(title="nanokv", version=nanokv.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server (vLLM's routes and request bodies).",
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return json_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += ("; the routes are /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                        "/detokenize, /health, /ping, /metrics, /version" + (", /docs" if docs else ""))
        return json_response(error_body(exc.status_code, message), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        # the traceback goes to the log only: exception text can hold paths, values and internals
        error_id = uuid.uuid4().hex[:12]
        logger.exception("%s %s failed (error %s)", request.method, request.url.path, error_id)
        return json_response(error_body(500, f"internal server error {error_id}; the server's log has the details"),
                             500)

    @app.post("/v1/completions", summary="Complete a prompt (OpenAI's legacy completions)",
              openapi_extra=_json_body({"model": settings.model_names[0], "prompt": "Hello", "max_tokens": 16}))
    async def completions(request: Request) -> Response:
        body, big = await read_json(request)
        return await serving.completions(body, request, offload=big)

    @app.post("/v1/chat/completions", summary="Answer a conversation (OpenAI's chat completions)",
              openapi_extra=_json_body({"model": settings.model_names[0],
                                        "messages": [{"role": "user", "content": "Hello"}]}))
    async def chat_completions(request: Request) -> Response:
        body, big = await read_json(request)
        return await serving.chat(body, request, offload=big)

    created = int(time.time())
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "nanokv",
              "root": llm.config.model, "parent": None, "max_model_len": llm.config.max_model_len}
             for name in settings.model_names]

    @app.get("/v1/models", summary="List the served model names")
    async def models() -> Response:
        return json_response({"object": "list", "data": cards})

    @app.get("/v1/models/{name:path}", summary="One served model")
    async def model(name: str) -> Response:
        for card in cards:
            if card["id"] == name:
                return json_response(card)
        raise model_not_found(name)

    @app.post("/tokenize", summary="Token ids of a prompt or a conversation (vLLM's /tokenize)",
              openapi_extra=_json_body({"prompt": "Hello", "add_special_tokens": True, "return_token_strs": True}))
    async def tokenize(request: Request) -> Response:
        body, big = await read_json(request)
        return json_response(await asyncio.to_thread(serving.tokenize, body) if big else serving.tokenize(body))

    @app.post("/detokenize", summary="The text of token ids (vLLM's /detokenize)",
              openapi_extra=_json_body({"tokens": [1, 2, 3]}))
    async def detokenize(request: Request) -> Response:
        body, big = await read_json(request)
        return json_response(await asyncio.to_thread(serving.detokenize, body) if big else serving.detokenize(body))

    if settings.tokenizer_info:
        @app.get("/tokenizer_info", summary="The tokenizer's configuration (vLLM's /tokenizer_info)")
        async def tokenizer_info() -> Response:
            return json_response(serving.tokenizer_info())

    @app.get("/health", summary="200 while the engine runs, else 503")
    async def health() -> Response:
        if llm.is_alive:
            return Response(status_code=200)
        return json_response(error_body(503, f"the engine is not running: {llm.dead_reason or 'not started'}"), 503)

    @app.get("/ping", summary="The same as /health (SageMaker's name)")
    async def ping() -> Response:
        return await health()

    @app.post("/ping", summary="The same as /health (SageMaker's name)")
    async def ping_post() -> Response:
        return await health()

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(await llm.snapshot()), media_type=CONTENT_TYPE)

    @app.get("/version", summary="nanokv's version")
    async def version() -> Response:
        return json_response({"version": nanokv.__version__})

    # the last added runs first: the request id (when asked for), the site checks, then CORS
    # (when asked for), then the key
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials)
    app.add_middleware(SiteGuard, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins)
    if settings.request_id_headers:
        app.add_middleware(RequestIdHeader)
    return app


def _json_body(example: dict) -> dict:
    """The OpenAPI entry of a route's JSON body (the routes read it themselves, so FastAPI
    cannot derive one): an object, with an example for /docs' "Try it out"."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "example": example}}}}}


async def read_json(request: Request) -> tuple[dict, bool]:
    """The body as a JSON object (APIError 400 otherwise, 413 past MAX_BODY_BYTES, 415
    without a JSON Content-Type), and whether it is big enough to be handled off the
    event loop."""
    _check_json_type(request.headers.get("content-type"))
    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the body is over {MAX_BODY_BYTES} bytes; send a smaller request")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody is left to answer: a 400 for the log, not a 500 and a traceback
        raise bad_request("the client disconnected before the whole body arrived; send it again") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the body is empty; send a JSON object such as "
                          '{"model": ..., "prompt": "Hello"}')
    big = len(raw) > OFFLOAD_BYTES
    body = await asyncio.to_thread(_parse, raw) if big else _parse(raw)
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got a JSON {type(body).__name__}; "
                          'send {"model": ..., ...}')
    return body, big


def _check_json_type(content_type: str | None) -> None:
    """415 unless the body is declared JSON: a web page can send text/plain or a form (or
    a typeless body) to any server without asking it first, but not application/json."""
    media = (content_type or "").partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
    raise APIError(415, f"the body must be sent as JSON, got {got}; send the header "
                        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')")


def _parse(raw: bytes):
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON ({e}); send a JSON object") from None
    if _too_deep(body, MAX_DEPTH):
        raise bad_request(f"the body nests more than {MAX_DEPTH} levels deep; no field needs that")
    return body


def _too_deep(value, limit: int) -> bool:
    """Whether lists and objects nest deeper than limit (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


class BearerAuth:
    """Every /v1 route needs `Authorization: Bearer <api key>` (pure ASGI, so streaming
    and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    def _allowed(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        # the scheme is case-insensitive (RFC 9110 11.1): "bearer" and "BEARER" are Bearer
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not self._allowed(given):
                body = error_body(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                       "with the server's --api-key")
                response = json_response(body, 401, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeader:
    """--enable-request-id-headers: every response carries X-Request-Id, the request's
    own or a new one (vLLM's header; pure ASGI, so streams pass through)."""

    _MAX = 256  # a longer id is not echoed (it would only grow every response)

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        request_id = given if 0 < len(given) <= self._MAX else uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# ---- the process ---------------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (it has stopped listening) first drains the engine:
    new requests get 503, unfinished ones are aborted after the grace period, so every
    client gets an answer (an error object, or an SSE error event and [DONE]) instead of
    a cut connection. Its listening sockets queue BACKLOG connections whatever the
    backlog asyncio accepts at a time (connections.py)."""

    def __init__(self, config, llm: AsyncLLM, grace: float):
        super().__init__(config)
        self._llm, self._grace = llm, grace

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                listen_queue(sock.fileno())

    async def shutdown(self, sockets=None) -> None:
        self._llm.drain(self._grace)
        await super().shutdown(sockets=sockets)


class _StopRequested(Exception):
    """SIGTERM or SIGINT before the server runs (while the model loads)."""


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """Load the model, serve until SIGTERM/SIGINT, shut down gracefully. Returns the exit
    code: 0 after a signal (in-flight requests finished, or aborted after
    settings.shutdown_timeout), 1 when the server cannot start (a port in use)."""
    from nanokv.llm_engine import LLMEngine

    state = {"server": None}

    def on_signal(signum, frame):
        server = state["server"]
        if server is None:
            raise _StopRequested
        server.should_exit = True  # a signal before uvicorn took over the handlers

    # before the model loads: a descriptor limit too low to serve fails at once
    max_connections, backlog = connection_limits(settings.max_connections, raise_fd_limit())
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            engine = LLMEngine(engine_args.create_engine_config())
        except _StopRequested:
            print("nanokv serve: stopped while loading the model", file=sys.stderr, flush=True)
            return 0
        llm = AsyncLLM(engine, max_waiting=settings.max_waiting)
        app = build_app(llm, settings)
        # uvicorn's own grace is a backstop: the app ends its requests after shutdown_timeout
        protocol = guarded_protocol(AutoHTTPProtocol, max_connections, settings.timeout_request_read,
                                    settings.timeout_response_write)
        logger.info("at most %d connections; a request must arrive within %g s, a client may stop reading its "
                    "response for %g s", max_connections, settings.timeout_request_read,
                    settings.timeout_response_write)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                access_log=settings.access_log, ssl_keyfile=settings.ssl_keyfile,
                                ssl_certfile=settings.ssl_certfile, ssl_ca_certs=settings.ssl_ca_certs,
                                ssl_cert_reqs=settings.ssl_cert_reqs,
                                timeout_graceful_shutdown=settings.shutdown_timeout + 10, lifespan="on",
                                timeout_keep_alive=settings.timeout_keep_alive, http=protocol, backlog=backlog)
        server = _Server(config, llm, settings.shutdown_timeout)
        state["server"] = server
        try:
            server.run()  # uvicorn handles SIGTERM/SIGINT while it runs, then re-raises them to on_signal
        finally:
            llm.shutdown()
        return 0 if server.started else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
