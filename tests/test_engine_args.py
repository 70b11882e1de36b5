"""EngineArgs: every engine argument once; LLM(...) and the CLI flags derive from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from nanokv import LLM
from nanokv.engine.arg_utils import EngineArgs
from nanokv.entrypoints.cli.arguments import build_parser, engine_args_from_cli
from nanokv.entrypoints.cli.common import Rank


def test_unknown_arguments_suggest_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'max_model_len'"):
        EngineArgs.from_kwargs(model="m", max_model_length=64)
    with pytest.raises(ValueError, match="did you mean 'gpu_memory_utilization'"):
        LLM("m", gpu_mem_utilization=0.5)
    with pytest.raises(ValueError, match="given twice"):
        EngineArgs.from_kwargs(model="m", block_size=8, kvcache_block_size=8)


def test_vllm_names_are_aliases(model_dir):
    args = EngineArgs.from_kwargs(model=model_dir, block_size=8, num_gpu_blocks_override=40, seed=None)
    assert (args.kvcache_block_size, args.num_kvcache_blocks) == (8, 40)
    llm = LLM(model_dir, block_size=8, num_gpu_blocks_override=40, max_model_len=128)
    config = llm.llm_engine.config
    assert (config.block_size, llm.kv_stats().num_blocks) == (8, 40)


def test_cli_flags_are_the_fields_with_their_defaults():
    parser = build_parser()
    gen = parser._subparsers._group_actions[0].choices["generate"]
    args = gen.parse_args(["--input", "in.jsonl", "--output", "out.jsonl"])
    engine = engine_args_from_cli(args, Rank())
    assert engine == EngineArgs()  # every default comes from EngineArgs
    actions = {}
    for a in gen._actions:  # the first flag of each field (--no-prefix-caching comes after)
        actions.setdefault(a.dest, a)
    for f in dataclasses.fields(EngineArgs):
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-") and action.default == f.default
        formatter = gen._get_formatter()
        formatter.add_argument(action)
        assert f"(default: {f.default})" in " ".join(formatter.format_help().split()), f.name
    args = gen.parse_args(["--input", "i", "--output", "o", "--block-size", "32", "--no-enable-prefix-caching",
                           "--max-model-len", "256", "--seed", "7"])
    engine = engine_args_from_cli(args, Rank())
    assert (engine.kvcache_block_size, engine.enable_prefix_caching, engine.max_model_len, engine.seed) == \
        (32, False, 256, 7)
    legacy = engine_args_from_cli(gen.parse_args(["--input", "i", "--output", "o", "--no-prefix-caching"]), Rank())
    assert legacy.enable_prefix_caching is False


def test_add_cli_args_round_trips_every_field():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()


@pytest.mark.parametrize("kwargs, match", [
    (dict(enforce_eager="yes"), "enforce_eager"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(attention_backend=3), "attention_backend"),
    (dict(seed=1.5), "seed"), (dict(max_logprobs=-1), "max_logprobs"),
])
def test_bad_engine_values(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **kwargs)
