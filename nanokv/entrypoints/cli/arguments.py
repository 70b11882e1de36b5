"""The command line's flags (build_parser), and what they become (SamplingParams, EngineArgs).

Imports neither torch nor transformers, so `nanokv --help`, every subcommand's --help and
a usage error answer at once: main() imports a subcommand's implementation only after the
command line has parsed."""

from __future__ import annotations

import argparse
import json

from nanokv import __version__
from nanokv.engine.arg_utils import DEFAULT_MODEL, EngineArgs
from nanokv.entrypoints.cli.common import InputError, Rank
from nanokv.entrypoints.openai.settings import ServerSettings
from nanokv.generation_config import FIELDS as GENERATION_FIELDS
from nanokv.sampling_params import SamplingParams


def sampling_params_from_args(args, defaults: dict | None = None) -> SamplingParams:
    """The sampling flags as SamplingParams; a generation-config flag not given (the model's
    defaults: temperature, top_p, ...) takes defaults' value (EngineConfig.default_sampling_params,
    known once the engine is built), else SamplingParams'."""
    try:
        return _sampling_params(args, defaults or {})
    except ValueError as e:
        raise InputError(f"bad sampling flag: {e}") from None


def _sampling_params(args, defaults: dict) -> SamplingParams:
    given = {name: getattr(args, name) for name in GENERATION_FIELDS.values() if hasattr(args, name)}
    return SamplingParams(
        n=args.n, seed=args.sampling_seed, min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output, logprobs=args.logprobs,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        skip_special_tokens=not args.no_skip_special_tokens, **{**defaults, **given})


def engine_args_from_cli(args, rank: Rank) -> EngineArgs:
    """The engine flags as EngineArgs; under torchrun each rank takes cuda:LOCAL_RANK."""
    if rank.world_size > 1 and args.tensor_parallel_size > 1:
        raise InputError("--tensor-parallel-size > 1 cannot be combined with torchrun data parallelism "
                         "(each process would need several devices); use one or the other")
    device = args.device
    if rank.world_size > 1 and device in ("auto", "cuda"):
        device = f"cuda:{rank.local_rank}" if _cuda_available() else "cpu"
    try:
        return EngineArgs.from_cli_args(args, model=model_from_args(args), device=device)
    except ValueError as e:  # a vLLM flag asking for what nanokv does not do
        raise InputError(str(e)) from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class NanokvParser(argparse.ArgumentParser):
    """The top-level parser: an argument no subcommand knows is reported with that
    subcommand's usage (argparse's own parse_args reports it with the top-level one)."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None):
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self.commands.get(getattr(namespace, "command", None), self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default once, in terms a user can act on: a help text that states its
    own default ("(default: ...)", or "(unset: ...)" for None) keeps it; "; None: what unset
    means" or a closing "(None: ...)" in a help whose default is None becomes "(default:
    what unset means)"; a switch (--ignore-eos, --no-progress) is off unless given, so
    nothing is added; a required option has no default."""

    def _get_help_string(self, action):
        help = action.help or ""
        if ("default:" in help.lower() or action.default is argparse.SUPPRESS or action.required
                or (not action.option_strings and action.nargs != "?")
                or (action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction))):
            return help
        if action.default is None:
            head, sep, meaning = help.partition("; None: ")
            if sep:
                return f"{head} (default: {meaning})"
            if help.endswith(")") and " (None: " in help:  # "... (None: all)"
                head, _, meaning = help[:-1].rpartition(" (None: ")
                return f"{head} (default: {meaning})"
            return help if "(unset: " in help else f"{help} (default: not set)"
        return f"{help} (default: %(default)s)"


def model_from_args(args) -> str:
    """The positional MODEL or --model (the same thing, given once)."""
    if args.model_tag is None:
        return args.model
    if args.model not in (DEFAULT_MODEL, args.model_tag):
        raise InputError(f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}; give it once")
    return args.model_tag


def build_parser() -> NanokvParser:
    parser = NanokvParser(prog="nanokv", description="nanokv command line")
    parser.add_argument("-v", "--version", action="version", version=__version__, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_chat_parsers(sub)
    mrg = sub.add_parser("merge", help="merge the part files of a torchrun generate run",
                         description="Append <output>.part-* to the output (skipping ids already "
                                     "there), merge the errors parts, remove the parts.")
    mrg.add_argument("--output", required=True, help="the output the parts belong to")
    mrg.add_argument("--world-size", type=_positive_int, required=True, help="how many ranks wrote parts")
    return parser


def _add_model_positional(parser, help: str = "the model (the same as --model; default: --model's default)"):
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=help)


def _add_engine_args(parser) -> None:
    eng = parser.add_argument_group("engine (LLM(...) arguments)")
    EngineArgs.add_cli_args(eng)
    # nanokv's first spelling of --no-enable-prefix-caching, kept working for old scripts
    eng.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                     help=argparse.SUPPRESS)


def _add_sampling_args(parser, title: str, *, max_tokens_help: str, max_tokens_default=argparse.SUPPRESS,
                       exclude: tuple[str, ...] = ()) -> None:
    """SamplingParams' fields as flags. The fields a model's generation config sets
    (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) default to not given
    (argparse.SUPPRESS): sampling_params_from_args fills them from the model's defaults,
    else SamplingParams'. max_tokens_default: the command's own default instead."""
    d = SamplingParams()
    model = "default: the model's generation config (--generation-config), else"
    smp = parser.add_argument_group(title)
    if "n" not in exclude:
        smp.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    smp.add_argument("--temperature", type=float, default=argparse.SUPPRESS, help=f"0 = greedy ({model} {d.temperature})")
    smp.add_argument("--top-p", type=float, default=argparse.SUPPRESS, help=f"nucleus mass, 1 = off ({model} {d.top_p})")
    smp.add_argument("--top-k", type=int, default=argparse.SUPPRESS,
                     help=f"keep the k most likely, -1 = off ({model} {d.top_k})")
    smp.add_argument("--min-p", type=float, default=argparse.SUPPRESS,
                     help=f"drop below min_p x the top probability ({model} {d.min_p})")
    smp.add_argument("--sampling-seed", type=int, default=None,
                     help="SamplingParams.seed for every request; None: seeded by the engine's --seed")
    if max_tokens_default is argparse.SUPPRESS:
        max_tokens_help = f"{max_tokens_help} ({model} {d.max_tokens})"
    smp.add_argument("--max-tokens", type=int, default=max_tokens_default, help=max_tokens_help)
    smp.add_argument("--min-tokens", type=int, default=d.min_tokens, help="no EOS or stop before this many")
    smp.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    smp.add_argument("--stop", action="append", default=None, help="a stop string (repeatable); None: none")
    smp.add_argument("--stop-token-ids", type=int, nargs="+", default=None, metavar="ID",
                     help="token ids that end generation besides EOS; None: none")
    smp.add_argument("--include-stop-str-in-output", action="store_true", help="keep the stop string in the text")
    if "logprobs" not in exclude:
        smp.add_argument("--logprobs", type=int, default=None,
                         help="top-N logprobs per generated token; None: no logprobs")
    smp.add_argument("--repetition-penalty", type=float, default=argparse.SUPPRESS,
                     help=f"1 = off ({model} {d.repetition_penalty})")
    smp.add_argument("--presence-penalty", type=float, default=d.presence_penalty, help="0 = off")
    smp.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty, help="0 = off")
    smp.add_argument("--no-skip-special-tokens", action="store_true", help="keep special tokens in the text")


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="offline batch generation: JSONL in, JSONL out",
                         formatter_class=HelpFormatter,
                         usage="nanokv generate [MODEL] --input INPUT --output OUTPUT [options]",
                         description="Generate for every line of a JSONL file; resumable; "
                                     "data parallel under torchrun.")
    _add_model_positional(gen)
    io = gen.add_argument_group("input and output")
    io.add_argument("--input", required=True, help="JSONL, one request per line")
    io.add_argument("--output", required=True, help="JSONL results (errors go to <stem>.errors.jsonl)")
    io.add_argument("--window", type=_positive_int, default=1024,
                    help="most requests read but unfinished at a time (bounds memory)")
    io.add_argument("--fsync-every", type=_positive_int, default=256, help="fsync after this many records")
    io.add_argument("--fsync-seconds", type=float, default=10.0, help="... or after this many seconds")
    io.add_argument("--allow-duplicate-ids", action="store_true",
                    help='repeated ids become "<id>#<k>" for the k-th occurrence instead of an error')
    io.add_argument("--id-from-line", action="store_true", help="a line without an id gets its line number")
    io.add_argument("--retry-errors", action="store_true", help="retry lines recorded in the errors file")
    io.add_argument("--no-line-seeds", dest="line_seeds", action="store_false",
                    help="do not seed requests without a seed from (--seed, id): faster sampling, "
                         "but sampled output then depends on batching, resume and sharding")
    io.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    io.add_argument("--no-merge", action="store_true", help="under torchrun: leave the part files for `nanokv merge`")
    io.add_argument("--dist-timeout", type=float, default=86400.0,
                    help="under torchrun: seconds a rank waits for the others at the path checks and the final barrier")
    io.add_argument("--rendezvous-timeout", type=float, default=300.0,
                    help="under torchrun: seconds a rank waits at startup for the others to join")
    _add_engine_args(gen)
    _add_sampling_args(gen, "sampling (SamplingParams defaults; a line's \"sampling_params\" overrides)",
                       max_tokens_help="generated-token limit")


def _add_chat_parsers(sub) -> None:
    """`nanokv chat` and `nanokv complete`: vLLM's flags (--url, --model-name, --api-key,
    --system-prompt, -q/--quick, --stats), with a local model unless --url is given."""
    chat = sub.add_parser("chat", help="chat with a model in the terminal, the answer streamed",
                          formatter_class=HelpFormatter, usage="nanokv chat [MODEL] [options]",
                          description="An interactive chat: each message goes through the chat template with "
                                      "the whole conversation, and the answer streams as it is generated. "
                                      "/reset starts a new conversation, /exit or Ctrl-D leaves, Ctrl-C stops "
                                      "an answer. The model runs here unless --url names a server.")
    comp = sub.add_parser("complete", help="complete prompts in the terminal, the completion streamed",
                          formatter_class=HelpFormatter, usage="nanokv complete [MODEL] [options]",
                          description="Each line read is a prompt (no chat template); its completion streams "
                                      "as it is generated. Ctrl-D leaves, Ctrl-C stops a completion. The "
                                      "model runs here unless --url names a server.")
    for parser, quick in ((chat, "MESSAGE"), (comp, "PROMPT")):
        _add_model_positional(parser, help="the model to load here (the same as --model; default: --model's "
                                           "default); with --url, the served model's name")
        opts = parser.add_argument_group(f"{parser.prog.split()[-1]} options")
        opts.add_argument("--url", default=None,
                          help="talk to a running nanokv or vLLM server at this OpenAI base URL (such as "
                               "http://127.0.0.1:8000/v1) instead of loading the model here; None: load it here")
        opts.add_argument("--model-name", default=None,
                          help="with --url: the model to ask for; None: MODEL, else the server's first in /v1/models")
        opts.add_argument("--api-key", default=None,
                          help="with --url: the bearer key; None: $OPENAI_API_KEY, else no key")
        if parser is chat:
            opts.add_argument("--system-prompt", default=None,
                              help="a system message to start every conversation with; None: none")
        opts.add_argument("-q", "--quick", default=None, metavar=quick,
                          help=f"send {quick} alone, print the streamed answer and exit; None: interactive")
        opts.add_argument("--stats", action="store_true",
                          help="after each answer, print the time to first token and tokens per second")
        _add_sampling_args(parser, "sampling (SamplingParams)", exclude=("n", "logprobs"),
                           max_tokens_help="generated-token limit; None: up to max_model_len",
                           max_tokens_default=None)
        parser.set_defaults(n=1, logprobs=None)
        _add_engine_args(parser)


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         formatter_class=HelpFormatter, usage="nanokv serve [MODEL] [options]",
                         description="Serve a model over HTTP with OpenAI's API: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                                     "/metrics. As in vLLM, flags may be spelled with underscores "
                                     "(--max_model_len) and --config FILE.yaml gives flags as keys.")
    srv.__class__ = _VllmStyleParser  # subparsers are built by add_parser; only serve takes vLLM's forms
    srv.add_argument("--config", metavar="FILE.yaml",
                     help="flags as a YAML mapping (port: 8001, enable-prefix-caching: true); flags given on "
                          "the command line win")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model (the same as --model; default: --model's default)")
    http = srv.add_argument_group("server")
    http.add_argument("--host", default=ServerSettings.host, help="address to listen on (0.0.0.0: every interface)")
    http.add_argument("--port", type=_port, default=ServerSettings.port, help="port to listen on")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="the model names clients may use (a response carries the name its request used; the first "
                           "is the default and the /metrics label); default: MODEL")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer <key>' on every /v1 route (unset: $NANOKV_API_KEY, "
                           "else $VLLM_API_KEY, else no key; an empty key is refused)")
    http.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                      help="Host names requests may use besides IP addresses and localhost (.example.com: a "
                           "domain and its subdomains; *: any); default: any on a network address, only those "
                           "over loopback (a DNS-rebinding defence)")
    http.add_argument("--allowed-origins", nargs="+", action=_ListAction, default=None, metavar="ORIGIN",
                      help="web origins (http://host:port, or *) whose pages may call the API: turns CORS on "
                           "for them (vLLM's JSON list '[\"*\"]' is taken too); default: none, cross-origin "
                           "browser requests get 403 (vLLM's default is every origin)")
    http.add_argument("--allowed-methods", nargs="+", action=_ListAction, default=list(ServerSettings.allowed_methods),
                      metavar="METHOD", help="HTTP methods cross-origin requests may use, once --allowed-origins "
                                             "turns CORS on (* any; a JSON list is taken too)")
    http.add_argument("--allowed-headers", nargs="+", action=_ListAction, default=list(ServerSettings.allowed_headers),
                      metavar="HEADER", help="request headers cross-origin requests may send, once --allowed-origins "
                                             "turns CORS on (* any; a JSON list is taken too)")
    http.add_argument("--allow-credentials", action="store_true", default=ServerSettings.allow_credentials,
                      help="let cross-origin requests carry cookies and credentials (CORS)")
    http.add_argument("--max-waiting", type=_positive_int, default=ServerSettings.max_waiting,
                      help="most sequences (prompts x n) queued for admission; beyond it requests get 503 "
                           "with Retry-After")
    http.add_argument("--max-response-tokens", type=_positive_int, default=ServerSettings.max_response_tokens,
                      help="most tokens plus logprob entries a non-streamed response may hold (prompts x n x "
                           "max_tokens x (1 + logprobs); max_tokens unset: what max_model_len leaves); beyond it "
                           "400 (streamed responses are not limited)")
    http.add_argument("--shutdown-timeout", type=_non_negative_float, default=ServerSettings.shutdown_timeout,
                      help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are aborted")
    http.add_argument("--timeout-keep-alive", type=_positive_float, default=ServerSettings.timeout_keep_alive,
                      help="seconds an idle HTTP keep-alive connection stays open (vLLM's and uvicorn's default: 5)")
    http.add_argument("--timeout-request-read", type=_positive_float, default=ServerSettings.timeout_request_read,
                      help="seconds a request has to arrive whole (headers and body) from its first byte, or from "
                           "the connection's opening; then the connection is closed (408 when its headers never "
                           "completed)")
    http.add_argument("--timeout-response-write", type=_positive_float,
                      default=ServerSettings.timeout_response_write,
                      help="seconds a response may wait on a client that stopped reading it (the socket's buffers "
                           "full); then the connection is dropped and its request aborted")
    http.add_argument("--max-connections", type=_positive_int, default=None,
                      help="most open client connections; at the limit a new one closes the oldest not being "
                           "served, or gets 503 (default: what the file descriptor limit allows, raised to the "
                           "hard limit at start)")
    http.add_argument("--enable-prompt-tokens-details", action="store_true",
                      help="report usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the "
                           "prefix cache; without it prompt_tokens_details is null")
    http.add_argument("--uvicorn-log-level", default=ServerSettings.log_level,
                      choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    http.add_argument("--disable-uvicorn-access-log", action="store_true", default=not ServerSettings.access_log,
                      help="no log line per HTTP request from uvicorn")
    http.add_argument("--disable-fastapi-docs", action="store_true", default=not ServerSettings.docs,
                      help="no /docs, /redoc and /openapi.json")
    http.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                      default=ServerSettings.log_requests,
                      help="log each request at INFO: its id, prompt, prompt token ids and sampling parameters")
    http.add_argument("--disable-log-requests", action="store_true",
                      help="accepted for vLLM's command lines; no effect (requests are logged only with "
                           "--enable-log-requests)")
    http.add_argument("--max-log-len", type=_non_negative_int, default=ServerSettings.max_log_len,
                      help="most prompt characters and prompt token ids a request's log line shows (None: all)")
    http.add_argument("--enable-tokenizer-info-endpoint", action="store_true", default=ServerSettings.tokenizer_info,
                      help="serve GET /tokenizer_info: the tokenizer's configuration and chat template")
    http.add_argument("--enable-request-id-headers", action="store_true", default=ServerSettings.request_id_headers,
                      help="responses carry an X-Request-Id header: the request's own, else a new id")
    http.add_argument("--disable-frontend-multiprocessing", action="store_true",
                      help="accepted for vLLM's command lines; no effect (the server and the engine share one "
                           "process)")
    http.add_argument("--api-server-count", "-asc", type=_positive_int, default=1,
                      help="HTTP server processes; nanokv runs one (vLLM's flag, only 1 is taken)")
    http.add_argument("--ssl-keyfile", default=ServerSettings.ssl_keyfile,
                      help="serve HTTPS with this private key (PEM), with --ssl-certfile")
    http.add_argument("--ssl-certfile", default=ServerSettings.ssl_certfile,
                      help="serve HTTPS with this certificate chain (PEM), with --ssl-keyfile")
    http.add_argument("--ssl-ca-certs", default=ServerSettings.ssl_ca_certs,
                      help="CA certificates (PEM) that client certificates are checked against")
    http.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=ServerSettings.ssl_cert_reqs,
                      help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    # vLLM's flags for features nanokv lacks: taken so that the refusal can say why (serve.py)
    for flag, (nargs, _) in REFUSED_SERVE_FLAGS.items():
        kind = {"action": "store_const", "const": True} if nargs == 0 else {"nargs": nargs}
        http.add_argument(flag, default=None, help=argparse.SUPPRESS, **kind)
    chat = srv.add_argument_group("chat and logprobs")
    chat.add_argument("--chat-template", default=ServerSettings.chat_template,
                      help="the chat template for chat completions and /tokenize: a file, or the template itself "
                           "(None: the tokenizer's)")
    chat.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"],
                      default=ServerSettings.chat_template_content_format,
                      help="how message content reaches the template: a string, text parts joined by newlines "
                           "('auto', 'string'), or OpenAI's list of {'type': 'text', 'text'} parts ('openai')")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      default=ServerSettings.trust_request_chat_template,
                      help="use a request's own chat_template (otherwise such a request gets 400)")
    chat.add_argument("--response-role", default=ServerSettings.response_role,
                      help="the role of a chat answer to a generation prompt")
    chat.add_argument("--return-tokens-as-token-ids", action="store_true",
                      default=ServerSettings.return_tokens_as_token_ids,
                      help="logprobs name tokens 'token_id:N' instead of their text (a request's "
                           "return_tokens_as_token_ids wins)")
    tools = srv.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       default=ServerSettings.enable_auto_tool_choice,
                       help="serve tool_choice 'auto' (and tools without a tool_choice): the model writes calls "
                            "freely and --tool-call-parser reads them; needs --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=ServerSettings.tool_call_parser,
                       help="how calls are read from the text with tool_choice auto, and the format the default "
                            "tools prompt asks for: hermes (<tool_call>{...}</tool_call> per call; Qwen, Hermes) "
                            "or smollm2 (<tool_call>[{...}, ...]</tool_call>)")
    _add_engine_args(srv)


class _VllmStyleParser(argparse.ArgumentParser):
    """vLLM's command-line forms, which deployment scripts written for vLLM use: --max_model_len
    for --max-model-len, and --config FILE.yaml, whose keys are flags placed before the
    command line's own (so those win)."""

    def parse_known_args(self, args=None, namespace=None):
        if args is not None:
            args = self._with_config([_dashed(a) for a in args])
        return super().parse_known_args(args, namespace)

    def _with_config(self, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            if arg == "--config" or arg.startswith("--config="):
                path = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
                if not path:
                    self.error("--config needs a YAML file")
                rest = args[:i] + args[i + (1 if "=" in arg else 2):]
                head = 1 if rest and not rest[0].startswith("-") else 0  # the positional MODEL stays first
                return rest[:head] + self._config_args(path) + rest[head:]
        return args

    def _config_args(self, path: str) -> list[str]:
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            self.error(f"--config {path}: {e}")
        if not isinstance(config, dict):
            self.error(f"--config {path}: expected a mapping of flags to values (port: 8001), got "
                       f"{type(config).__name__}")
        flags = {opt for action in self._actions for opt in action.option_strings}
        out = []
        for key, value in config.items():
            flag = "--" + str(key).replace("_", "-")
            if value is None or value is False and f"--no-{flag[2:]}" not in flags:
                continue  # unset, or a switch left off
            if isinstance(value, bool):
                out.append(flag if value else f"--no-{flag[2:]}")
            elif isinstance(value, list):
                out += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
            else:
                out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        return out


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


class _ListAction(argparse.Action):
    """nargs="+" values, each a plain word or vLLM's JSON list ('["GET", "POST"]')."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = []
        for value in values:
            if value.lstrip().startswith("["):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise argparse.ArgumentError(self, f"{value!r} is not a JSON list: {e}") from None
                if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                    raise argparse.ArgumentError(self, f"{value!r} must be a JSON list of strings")
                items += parsed
            else:
                items.append(value)
        setattr(namespace, self.dest, items)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# vLLM serve flags nanokv refuses: flag -> (how many values it takes, what nanokv lacks)
REFUSED_SERVE_FLAGS = {
    "--tool-parser-plugin": (1, "tool-parser plugins (the parsers are built in: --tool-call-parser)"), "--reasoning-parser": (1, "reasoning parsers"),
    "--lora-modules": ("+", "LoRA adapters"), "--uds": (1, "serving on a Unix socket"),
    "--root-path": (1, "a root path (serve it at / behind the proxy)"), "--middleware": (1, "ASGI middleware plugins"),
}


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
