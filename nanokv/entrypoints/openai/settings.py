"""The server's settings besides the engine arguments, and their defaults: the one source
for `nanokv serve`'s flags (arguments.py) and the app (api_server.py). Imports nothing
of the serve extra, so the CLI can read the defaults without fastapi."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """What the server needs besides the engine arguments."""

    # --served-model-name (the first is reported); empty: EngineArgs.served_model_name, else the model
    model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # Host names accepted besides IP addresses and localhost; empty: checked only for
    # requests that arrive over loopback; "*": not checked (sites.py)
    allowed_hosts: tuple[str, ...] = ()
    # CORS: off unless allowed_origins names an origin (vLLM's defaults are ["*"] for all three
    # and CORS always on); methods and headers apply once it is on
    allowed_origins: tuple[str, ...] = ()  # web origins that may call the API; empty: none
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False  # cookies and Authorization on cross-origin requests
    max_waiting: int | None = 1024  # sequences queued for admission; beyond it 503
    # A non-streamed response is held whole until it is sent: prompts x n x max_tokens x
    # (1 + logprobs) at most (max_tokens unset: what max_model_len leaves after the prompt),
    # a 400 beyond. A logprob entry costs a few hundred bytes of Python objects and JSON,
    # so about 200 MB at the limit. Streamed responses hold one step and are not limited.
    max_response_tokens: int = 2**19
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open (vLLM's, uvicorn's)
    # seconds a request has to arrive whole (headers and body) from its first byte, or from
    # the connection's opening; then the connection is closed (connections.py)
    timeout_request_read: float = 30.0
    # seconds a response may wait on a client that does not read it (the connection's
    # writes paused by flow control); then the connection is dropped and its request
    # aborted (connections.py)
    timeout_response_write: float = 30.0
    max_connections: int | None = None  # None: as many as the file descriptor limit allows (connections.py)
    log_level: str = "info"  # uvicorn's
    # usage.prompt_tokens_details = {"cached_tokens": prompt tokens found in the prefix cache}
    # (vLLM's --enable-prompt-tokens-details); False: null
    enable_prompt_tokens_details: bool = False
    access_log: bool = True  # uvicorn's line per request (--disable-uvicorn-access-log turns it off)
    docs: bool = True  # /docs, /redoc and /openapi.json (--disable-fastapi-docs turns them off)
    # the chat template's text for chat completions and /tokenize (--chat-template: a file or
    # the template itself); None: the tokenizer's
    chat_template: str | None = None
    # how message content reaches the template: a string ("auto", "string": text parts joined by
    # newlines) or OpenAI's list of parts ("openai")
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False  # whether a request's own chat_template is used (else 400)
    response_role: str = "assistant"  # the role of the answer when add_generation_prompt is true
    # logprobs name tokens "token_id:N" instead of their text (a request's own
    # return_tokens_as_token_ids wins)
    return_tokens_as_token_ids: bool = False
    log_requests: bool = False  # an INFO line per request: id, prompt, token ids, sampling params
    tokenizer_info: bool = False  # GET /tokenizer_info (the tokenizer's configuration, its chat template)
    # seconds between the periodic stats lines (vLLM's default; $VLLM_LOG_STATS_INTERVAL sets
    # it); EngineArgs.disable_log_stats turns them off (stats_log.py)
    log_stats_interval: float = 10.0
    request_id_headers: bool = False  # responses carry X-Request-Id (the request's own, else a new one)
    # HTTPS (uvicorn's): the key and certificate files, both or neither; the CA certificates
    # and whether clients must present a certificate (ssl.CERT_NONE 0, OPTIONAL 1, REQUIRED 2)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    max_log_len: int | None = None  # prompt characters and token ids a request's log line shows; None: all
    # tool_choice "auto" (also tools without a tool_choice) is served only with both (vLLM's
    # --enable-auto-tool-choice --tool-call-parser NAME); the parser (nanokv/tool_calls.py
    # TOOL_PARSERS) reads calls out of the text and names the default tools prompt's format
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)
        check_allowed_hosts(self.allowed_hosts)
        check_allowed_origins(self.allowed_origins)
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"--chat-template-content-format must be auto, string or openai, got "
                             f"{self.chat_template_content_format!r}")
        if not self.response_role.strip():
            raise ValueError("--response-role is empty; give a role name such as assistant")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile; give both, or neither for HTTP")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')}: {path!r} is not a file")
        if not self.log_stats_interval > 0:
            raise ValueError(f"$VLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got "
                             f"{self.log_stats_interval}")
        if self.tool_call_parser is not None:
            from nanokv.tool_calls import get_parser

            get_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (hermes or smollm2)")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")


def check_api_key(key: str) -> None:
    """ValueError for a key that cannot protect anything: empty (an unset variable in
    `--api-key "$KEY"`) or with surrounding whitespace (no client can send it)."""
    if not key.strip():
        raise ValueError("the API key is empty: the server would take every request without authentication; "
                         "give a non-empty key, or leave it unset to serve without one")
    if key != key.strip():
        raise ValueError("the API key starts or ends with whitespace, which no HTTP client can send "
                         "(header values are trimmed); remove it")


_ORIGIN = re.compile(r"https?://[^/\s?#]+")


def check_allowed_hosts(hosts: tuple[str, ...]) -> None:
    for host in hosts:
        if not host or host != host.strip() or any(c in host for c in "/@ \t") or "://" in host:
            raise ValueError(f"--allowed-hosts: {host!r} is not a host name; give names such as my-box.lan, "
                             "a leading dot for a domain and its subdomains (.example.com), or * for any")


def check_allowed_origins(origins: tuple[str, ...]) -> None:
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin; give scheme://host[:port] "
                             "(http://localhost:3000, no path) or * for any")


_JINJA_CHARS = "{}\n"  # a value holding any of these is a template, not a path (vLLM's rule)


def load_chat_template(value: str) -> str:
    """--chat-template's value as the template's text: the file it names, or (holding
    braces or a newline) the template itself, with backslash escapes such as \\n
    decoded. ValueError for a path that is not a file."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in _JINJA_CHARS):
        # a one-line template from a shell writes newlines as \n; non-ASCII text survives
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape") if "\\" in value else value
    raise ValueError(f"--chat-template: {value!r} is not a file, nor a template (a Jinja template holds "
                     "{{ or {%); give the path of a .jinja file or the template itself")
