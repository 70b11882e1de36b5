"""EngineArgs: every engine argument once; LLM(...) and the CLI flags derive from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil

import pytest

from nanokv import LLM, SamplingParams
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
        if not f.metadata["flag"]:  # served_model_name: serve's own --served-model-name
            assert f.name not in actions
            continue
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-") and action.default == f.default
        formatter = gen._get_formatter()
        formatter.add_argument(action)
        help = f.metadata["help"]
        if f.default is not None:
            shown = f.default
        elif "; None: " in help:  # what None means, in words
            shown = help.partition("; None: ")[2]
        elif help.endswith(")") and " (None: " in help:
            shown = help[:-1].rpartition(" (None: ")[2]
        else:
            shown = "not set"
        assert f"(default: {shown})" in " ".join(formatter.format_help().split()), f.name
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
    (dict(seed=1.5), "seed"), (dict(max_logprobs=-2), "max_logprobs"),
])
def test_bad_engine_values(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **kwargs)


SMALL = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256)


def test_did_you_mean_suggests_only_really_close_names():
    for typo, name in [("gpu_mem_utilization", "gpu_memory_utilization"), ("enforce_eagre", "enforce_eager"),
                       ("num_gpu_blocks", "num_gpu_blocks_override"), ("enable_prefix_cache", "enable_prefix_caching")]:
        with pytest.raises(ValueError, match=f"did you mean '{name}'"):
            EngineArgs.from_kwargs(model="m", **{typo: 1})
    for far in ("tokenizer_name", "speculative_model", "max_tokens", "kv_cache_size"):
        with pytest.raises(ValueError, match="known: ") as e:
            EngineArgs.from_kwargs(model="m", **{far: 1})
        assert "did you mean" not in str(e.value), far


def test_a_vllm_script_arguments_are_accepted_and_the_ineffective_logged_once(model_dir, caplog):
    vllm_script = dict(
        trust_remote_code=True, revision="main", tokenizer_revision="main", download_dir="/nonexistent",
        swap_space=8, cpu_offload_gb=0, max_seq_len_to_capture=4096, compilation_config={"level": 3},
        distributed_executor_backend="mp", load_format="safetensors", task="generate", runner="auto",
        enable_chunked_prefill=True, generation_config="auto", tokenizer_mode="auto", hf_overrides={},
        served_model_name="my-model", pipeline_parallel_size=1, data_parallel_size=1, enable_lora=False,
        disable_custom_all_reduce=True, skip_tokenizer_init=False, hf_token=None, scheduling_policy="fcfs",
        limit_mm_per_prompt={}, async_scheduling=True, **SMALL)
    with caplog.at_level(logging.INFO, logger="nanokv"):
        llm = LLM(model_dir, **vllm_script)
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.llm_engine.config.served_model_name == ("my-model",)
    for given in ("trust_remote_code=True", "revision='main'", "tokenizer_revision='main'",
                  "download_dir='/nonexistent'", "swap_space=8", "max_seq_len_to_capture=4096",
                  "compilation_config={'level': 3}", "disable_custom_all_reduce=True", "async_scheduling=True"):
        logged = [r for r in caplog.records if f"engine argument {given}" in r.getMessage()]
        assert len(logged) == 1 and logged[0].levelno == logging.INFO, given
    for quiet in ("load_format", "skip_tokenizer_init", "hf_token", "scheduling_policy"):  # effect, or off
        assert not [r for r in caplog.records if f"engine argument {quiet}" in r.getMessage()], quiet


@pytest.mark.parametrize("kwargs, match", [
    (dict(enable_chunked_prefill=False), "max_num_batched_tokens >= max_model_len"),
    (dict(cpu_offload_gb=2), "keeps every weight on the device"),
    (dict(distributed_executor_backend="ray"), "Ray is not supported"),
    (dict(distributed_executor_backend="external_launcher"), "torchrun"),
    (dict(task="embed"), "pooling models"), (dict(runner="pooling"), "pooling models"),
    (dict(task="transcribe"), "unknown task"),
    (dict(tokenizer_mode="mistral"), "mistral_common"), (dict(tokenizer_mode="fast"), "unknown tokenizer_mode"),
    (dict(load_format="gguf"), "is a Hugging Face"), (dict(load_format="dummy"), "random weights"),
    (dict(load_format="pt"), "safetensors"), (dict(generation_config=3), "generation_config"),
    (dict(enable_lora=True), "LoRA"), (dict(speculative_config={"num_speculative_tokens": 2}), "speculative"),
    (dict(pipeline_parallel_size=2), "tensor_parallel_size"), (dict(scheduling_policy="priority"), "first come"),
    (dict(logits_processors=[print]), "logits processors"), (dict(hf_overrides=[1]), "hf_overrides"),
    (dict(hf_overrides={"hidden_size": 96}), "hidden"), (dict(served_model_name=""), "served_model_name"),
    (dict(tokenizer="/nonexistent/tokenizer"), "neither a directory nor a .gguf"),
])
def test_vllm_arguments_nanokv_does_not_implement_are_refused_with_a_reason(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **SMALL, **kwargs)


def test_hf_overrides_are_set_on_the_model_config(model_dir):
    llm = LLM(model_dir, hf_overrides={"max_position_embeddings": 200}, kv_cache_memory_bytes=64 << 20)
    assert llm.llm_engine.config.max_model_len == 200  # from the overridden config
    assert llm.llm_engine.config.hf_config.max_position_embeddings == 200
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["max_position_embeddings"] == 1024  # the file is not touched
    assert LLM(model_dir, kv_cache_memory_bytes=64 << 20).llm_engine.config.max_model_len == 1024


def test_a_separate_tokenizer_is_loaded_and_must_fit_the_vocabulary(checkpoint, model_dir, tmp_path):
    small = checkpoint("qwen3-tiny", vocab_size=512)  # its tokenizer has 512 tokens, the model's 1024
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    for name in os.listdir(small):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(small, name), tok_dir)
    llm = LLM(model_dir, tokenizer=str(tok_dir), **SMALL)
    assert len(llm.get_tokenizer()) == 512 != len(LLM(model_dir, **SMALL).get_tokenizer())
    out = llm.generate("Hello there", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer()("Hello there").input_ids
    with pytest.raises(ValueError, match="1024 tokens but the model's vocabulary is 512"):
        LLM(small, tokenizer=model_dir, **SMALL)


def test_disable_log_stats_drops_the_kv_summary_line(model_dir, caplog):
    # LLM(...) defaults to disable_log_stats=True, as vLLM's LLM does
    loud, quiet = LLM(model_dir, disable_log_stats=False, **SMALL), LLM(model_dir, **SMALL)
    for engine, expected in ((loud, 1), (quiet, 0)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nanokv"):
            engine.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        assert sum("KV cache:" in r.getMessage() for r in caplog.records) == expected


def test_dict_valued_flags_take_json():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--hf-overrides", '{"max_position_embeddings": 4096, "rope_scaling": {"factor": 2}}',
                              "--compilation-config", "3", "--no-trust-remote-code", "--swap-space", "0.5"])
    engine = EngineArgs.from_cli_args(args)
    assert engine.hf_overrides == {"max_position_embeddings": 4096, "rope_scaling": {"factor": 2}}
    assert (engine.compilation_config, engine.trust_remote_code, engine.swap_space) == (3, False, 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "{max_position_embeddings: 1}"])


def test_the_server_answers_to_served_model_name_when_its_flag_gives_none(model_dir):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import asyncio

    from nanokv.async_llm import AsyncLLM
    from nanokv.entrypoints.openai.api_server import ServerSettings, build_app
    from nanokv.llm_engine import LLMEngine

    offline = LLM(model_dir, served_model_name=["my-model", "alias"], **SMALL)
    llm = AsyncLLM(LLMEngine(offline.llm_engine.config, tokenizer=offline.get_tokenizer()))
    app = build_app(llm, ServerSettings())  # no --served-model-name

    async def models():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.get("/v1/models")

    try:
        resp = asyncio.run(asyncio.wait_for(models(), 60))
    finally:
        llm.shutdown()
    assert [m["id"] for m in resp.json()["data"]] == ["my-model", "alias"]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_vllm_flags_without_a_field_parse_and_are_refused_only_when_they_ask_for_something(command):
    """A `vllm serve` line carrying --pipeline-parallel-size 1 or --no-enable-lora runs;
    --enable-lora or --pipeline-parallel-size 2 stops with the reason, not argparse's bare
    'unrecognized arguments'; none of them shows in --help."""
    from nanokv.entrypoints.cli.common import InputError

    parser = build_parser()
    io = ["--input", "i.jsonl", "--output", "o.jsonl"] if command == "generate" else []
    off = ["--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--no-enable-lora",
           "--scheduling-policy", "fcfs", "--max-parallel-loading-workers", "4", "--disable-custom-all-reduce",
           "--logits-processors", "--limit-mm-per-prompt", "{}"]
    args = parser.parse_args([command, "m", *io, *off])
    assert engine_args_from_cli(args, Rank()).model == "m"
    for on, reason in ((["--pipeline-parallel-size", "2"], "pipeline parallelism"),
                       (["--enable-lora"], "LoRA"), (["--max-loras", "2"], None),
                       (["--speculative-config", '{"method": "ngram"}'], "speculative decoding"),
                       (["--scheduling-policy", "priority"], "first come"), (["--headless"], "headless")):
        args = parser.parse_args([command, "m", *io, *on])
        if reason is None:  # no effect (LoRA is refused by --enable-lora itself)
            engine_args_from_cli(args, Rank())
            continue
        with pytest.raises(InputError, match=reason):
            engine_args_from_cli(args, Rank())
    help = parser.commands[command].format_help()
    assert "--pipeline-parallel-size" not in help and "--enable-lora" not in help
