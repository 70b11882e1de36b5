"""The command line's flags, and what they become (SamplingParams, LLM arguments)."""

from __future__ import annotations

import argparse

from nanokv.engine.arg_utils import EngineArgs
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
    return EngineArgs.from_cli_args(args, device=device)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanokv", description="nanokv command line")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline batch generation: JSONL in, JSONL out",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Generate for every line of a JSONL file; resumable; "
                                     "data parallel under torchrun.")
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

    eng = gen.add_argument_group("engine (LLM(...) arguments)")
    EngineArgs.add_cli_args(eng)
    eng.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                     help="the same as --no-enable-prefix-caching")

    d = SamplingParams()
    smp = gen.add_argument_group("sampling (SamplingParams defaults; a line's \"sampling_params\" overrides)")
    model = "default: the model's generation config (--generation-config), else"  # the flags default=SUPPRESS
    smp.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    smp.add_argument("--temperature", type=float, default=argparse.SUPPRESS,
                     help=f"0 = greedy ({model} {d.temperature})")
    smp.add_argument("--top-p", type=float, default=argparse.SUPPRESS, help=f"nucleus mass, 1 = off ({model} {d.top_p})")
    smp.add_argument("--top-k", type=int, default=argparse.SUPPRESS,
                     help=f"keep the k most likely, -1 = off ({model} {d.top_k})")
    smp.add_argument("--min-p", type=float, default=argparse.SUPPRESS,
                     help=f"drop below min_p x the top probability ({model} {d.min_p})")
    smp.add_argument("--sampling-seed", type=int, default=None, help="SamplingParams.seed for every line")
    smp.add_argument("--max-tokens", type=int, default=argparse.SUPPRESS,
                     help=f"generated-token limit ({model} {d.max_tokens})")
    smp.add_argument("--min-tokens", type=int, default=d.min_tokens, help="no EOS or stop before this many")
    smp.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    smp.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    smp.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="token ids that end generation")
    smp.add_argument("--include-stop-str-in-output", action="store_true", help="keep the stop string in the text")
    smp.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per generated token")
    smp.add_argument("--repetition-penalty", type=float, default=argparse.SUPPRESS,
                     help=f"1 = off ({model} {d.repetition_penalty})")
    smp.add_argument("--presence-penalty", type=float, default=d.presence_penalty, help="0 = off")
    smp.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty, help="0 = off")
    smp.add_argument("--no-skip-special-tokens", action="store_true", help="keep special tokens in the text")

    _add_serve_parser(sub)

    mrg = sub.add_parser("merge", help="merge the part files of a torchrun generate run",
                         description="Append <output>.part-* to the output (skipping ids already "
                                     "there), merge the errors parts, remove the parts.")
    mrg.add_argument("--output", required=True, help="the output the parts belong to")
    mrg.add_argument("--world-size", type=_positive_int, required=True, help="how many ranks wrote parts")
    return parser


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         description="Serve a model over HTTP with OpenAI's API: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics.")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model (the same as --model; default: --model's default)")
    http = srv.add_argument_group("server")
    http.add_argument("--host", default=ServerSettings.host, help="address to listen on (0.0.0.0: every interface)")
    http.add_argument("--port", type=_port, default=ServerSettings.port, help="port to listen on")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="the model names clients may use (a response carries the name its request used; the first "
                           "is the default and the /metrics label); default: MODEL")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer <key>' on every /v1 route (unset: $NANOKV_API_KEY "
                           "if set, else no key; an empty key is refused)")
    http.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                      help="Host names requests may use besides IP addresses and localhost (.example.com: a "
                           "domain and its subdomains; *: any); default: any on a network address, only those "
                           "over loopback (a DNS-rebinding defence)")
    http.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                      help="web origins (http://host:port, or *) whose pages may call the API: turns CORS on "
                           "for them; default: none, cross-origin browser requests get 403")
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
                           "prefix cache (default: prompt_tokens_details is null)")
    http.add_argument("--uvicorn-log-level", default=ServerSettings.log_level,
                      choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    eng = srv.add_argument_group("engine (LLM(...) arguments)")
    EngineArgs.add_cli_args(eng)
    eng.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                     help="the same as --no-enable-prefix-caching")


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
