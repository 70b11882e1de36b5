"""`nanokv serve`: check the server's packages are there, turn the flags into EngineArgs and
ServerSettings, and run the server (nanokv/entrypoints/openai/api_server.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re

from nanokv.engine.arg_utils import EngineArgs
from nanokv.entrypoints.cli.arguments import model_from_args
from nanokv.entrypoints.cli.common import EXIT_USAGE, InputError, say

API_KEY_ENV = "NANOKV_API_KEY"  # the key when --api-key is not given
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's name for it, read after NANOKV_API_KEY
STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"  # vLLM's: seconds between the periodic stats lines
_SERVER_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def server_requirements(packages: list[str]) -> list[str]:
    """The packages' requirement strings as nanokv's metadata declares them (one source:
    pyproject.toml); a bare name where nanokv's metadata cannot be read."""
    try:
        declared = importlib.metadata.requires("nanokv") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    by_name = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower(): r.split(";")[0].strip() for r in declared}
    return [by_name.get(p.lower(), p) for p in packages]


def missing_server_packages() -> list[str]:
    missing = []
    for module, package in _SERVER_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken install
            found = False
        if not found:
            missing.append(package)
    return missing


def serve(args) -> int:
    missing = missing_server_packages()
    if missing:
        say(f"nanokv serve: error: the server needs {', '.join(missing)}, which nanokv installs: "
            f"pip install {' '.join(repr(r) for r in server_requirements(missing))}")
        return EXIT_USAGE
    model = model_from_args(args)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("nanokv").setLevel(logging.INFO)

    from nanokv.entrypoints.openai.api_server import run_server
    from nanokv.entrypoints.openai.settings import ServerSettings, check_api_key, load_chat_template

    api_key, key_source = _api_key(args.api_key)
    if api_key is not None:  # an empty one ("$UNSET_VARIABLE") is refused, never taken as "no key"
        try:
            check_api_key(api_key)
        except ValueError as e:
            raise InputError(f"{key_source}: {e}") from None
    _check_vllm_only_flags(args)
    try:
        chat_template = None if args.chat_template is None else _check_template(load_chat_template(args.chat_template))
        settings = ServerSettings(
            model_names=tuple(args.served_model_name or [model]), host=args.host, port=args.port,
            api_key=api_key, allowed_hosts=tuple(args.allowed_hosts or ()),
            allowed_origins=tuple(args.allowed_origins or ()), allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
            max_waiting=args.max_waiting,
            max_response_tokens=args.max_response_tokens, shutdown_timeout=args.shutdown_timeout,
            timeout_keep_alive=args.timeout_keep_alive, timeout_request_read=args.timeout_request_read,
            timeout_response_write=args.timeout_response_write,
            max_connections=args.max_connections, log_level=args.uvicorn_log_level,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            access_log=not args.disable_uvicorn_access_log,
            docs=not args.disable_fastapi_docs, chat_template=chat_template,
            trust_request_chat_template=args.trust_request_chat_template,
            chat_template_content_format=args.chat_template_content_format, response_role=args.response_role,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids, log_requests=args.log_requests,
            max_log_len=args.max_log_len, request_id_headers=args.enable_request_id_headers,
            tokenizer_info=args.enable_tokenizer_info_endpoint, **_stats_interval(),
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs, enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser)
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None
    try:
        return run_server(EngineArgs.from_cli_args(args, model=model), settings)
    except ValueError as e:  # a bad engine flag or model
        raise InputError(str(e)) from None


def _check_vllm_only_flags(args) -> None:
    """vLLM's flags a deployment script carries that mean nothing here: said so in the
    log, or refused when they ask for what nanokv cannot do."""
    log = logging.getLogger("nanokv")
    if args.disable_log_requests:
        log.info("--disable-log-requests has no effect: requests are logged only with --enable-log-requests")
    if args.disable_frontend_multiprocessing:
        log.info("--disable-frontend-multiprocessing has no effect: the server and the engine share one process")
    if args.api_server_count != 1:
        raise InputError(f"--api-server-count {args.api_server_count}: nanokv runs one HTTP server process; "
                         "give 1 or drop the flag (run several servers behind a load balancer instead)")
    from nanokv.entrypoints.cli.arguments import REFUSED_SERVE_FLAGS

    for flag, (_, what) in REFUSED_SERVE_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            raise InputError(f"{flag}: nanokv's server does not support {what}; drop the flag")


def _stats_interval() -> dict:
    """$VLLM_LOG_STATS_INTERVAL as ServerSettings' log_stats_interval, when set."""
    text = os.environ.get(STATS_INTERVAL_ENV)
    if text is None:
        return {}
    try:
        return {"log_stats_interval": float(text)}
    except ValueError:
        raise InputError(f"${STATS_INTERVAL_ENV} must be a number of seconds, got {text!r}") from None


def _api_key(flag: str | None) -> tuple[str | None, str]:
    """The key and where it came from: --api-key, else $NANOKV_API_KEY, else $VLLM_API_KEY;
    the two variables set to different keys is an error (which one protects the server?)."""
    if flag is not None:
        return flag, "--api-key"
    ours, vllms = os.environ.get(API_KEY_ENV), os.environ.get(VLLM_API_KEY_ENV)
    if ours is not None and vllms is not None and ours != vllms:
        raise InputError(f"${API_KEY_ENV} and ${VLLM_API_KEY_ENV} are both set, to different keys; unset one, "
                         "or give the key with --api-key")
    if ours is not None:
        return ours, f"${API_KEY_ENV}"
    return vllms, f"${VLLM_API_KEY_ENV}"


def _check_template(template: str) -> str:
    """A chat template that is not valid Jinja fails at start, not at the first request."""
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"--chat-template is not a valid Jinja template: {e} (line {e.lineno})") from None
    return template
