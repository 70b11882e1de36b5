"""The command line's flags, and what they become (SamplingParams, LLM arguments)."""

from __future__ import annotations

import argparse

from nanokv.entrypoints.cli.common import InputError, Rank
from nanokv.sampling_params import SamplingParams


def sampling_params_from_args(args) -> SamplingParams:
    try:
        return _sampling_params(args)
    except ValueError as e:
        raise InputError(f"bad sampling flag: {e}") from None


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output, logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, skip_special_tokens=not args.no_skip_special_tokens)


def engine_kwargs_from_args(args, rank: Rank) -> dict:
    if rank.world_size > 1 and args.tensor_parallel_size > 1:
        raise InputError("--tensor-parallel-size > 1 cannot be combined with torchrun data parallelism "
                         "(each process would need several devices); use one or the other")
    device = args.device
    if rank.world_size > 1 and device in ("auto", "cuda"):
        device = f"cuda:{rank.local_rank}" if _cuda_available() else "cpu"
    return dict(
        dtype=args.dtype, device=device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kvcache_block_size=args.kvcache_block_size,
        num_kvcache_blocks=args.num_kvcache_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager, seed=args.seed, attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size)


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
                         description="Generate for every line of a JSONL file; resumable; "
                                     "data parallel under torchrun.")
    io = gen.add_argument_group("input and output")
    io.add_argument("--model", required=True, help="Hugging Face model directory")
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
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--device", default="auto", help="auto/cpu/cuda; under torchrun cuda:LOCAL_RANK")
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--kvcache-block-size", type=int, default=16)
    eng.add_argument("--num-kvcache-blocks", type=int, default=None)
    eng.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--enforce-eager", action="store_true")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--attention-backend", default="auto")
    eng.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="shard the model over N devices (not with torchrun data parallelism)")

    d = SamplingParams()
    smp = gen.add_argument_group("sampling (SamplingParams defaults; a line's \"sampling_params\" overrides)")
    smp.add_argument("--n", type=int, default=d.n)
    smp.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    smp.add_argument("--top-p", type=float, default=d.top_p)
    smp.add_argument("--top-k", type=int, default=d.top_k)
    smp.add_argument("--min-p", type=float, default=d.min_p)
    smp.add_argument("--sampling-seed", type=int, default=None, help="SamplingParams.seed for every line")
    smp.add_argument("--max-tokens", type=int, default=d.max_tokens)
    smp.add_argument("--min-tokens", type=int, default=d.min_tokens)
    smp.add_argument("--ignore-eos", action="store_true")
    smp.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    smp.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    smp.add_argument("--include-stop-str-in-output", action="store_true")
    smp.add_argument("--logprobs", type=int, default=None)
    smp.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    smp.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    smp.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    smp.add_argument("--no-skip-special-tokens", action="store_true")

    mrg = sub.add_parser("merge", help="merge the part files of a torchrun generate run",
                         description="Append <output>.part-* to the output (skipping ids already "
                                     "there), merge the errors parts, remove the parts.")
    mrg.add_argument("--output", required=True)
    mrg.add_argument("--world-size", type=_positive_int, required=True)
    return parser
