"""The vLLM offline names behind the ported script (tests/test_vllm_offline_script.py), one
behaviour per test on the tiny checkpoint: the config views, the LLM methods vLLM has
(profiling, apply_model, collective_rpc, sleep refused), EngineArgs built directly, the
argument parser, max_logprobs=-1 and the module paths vLLM scripts import."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import pytest

from nanokv import LLM, SamplingParams
from nanokv.engine.arg_utils import EngineArgs

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def test_engine_config_views_hold_the_engines_values(llm):
    engine = llm.llm_engine
    config = engine.config
    model = engine.get_model_config()
    assert model is engine.model_config is llm.model_config is engine.vllm_config.model_config
    assert (model.model, model.max_model_len, model.dtype, model.seed) == (config.model, 512, config.dtype, config.seed)
    assert model.get_vocab_size() == config.hf_config.vocab_size == model.hf_config.vocab_size
    assert model.get_sliding_window() is None and model.served_model_name == config.model
    assert model.get_diff_sampling_param() == config.default_sampling_params
    cache = engine.cache_config
    assert (cache.block_size, cache.num_gpu_blocks, cache.enable_prefix_caching) == \
        (config.block_size, engine.block_manager.num_blocks, True)
    assert engine.vllm_config.scheduler_config.max_num_seqs == config.max_num_seqs
    assert engine.vllm_config.parallel_config.tensor_parallel_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.max_model_len = 4  # a view: changing it would change nothing


def test_llm_defaults_disable_log_stats_like_vllm(model_dir):
    assert EngineArgs().disable_log_stats is False  # the server's and the CLI's default
    llm = LLM(model_dir, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.config.disable_log_stats is True
    llm.close()


def test_engine_args_built_directly_take_vllm_names(caplog):
    with pytest.raises(ValueError, match="enable_lora=True is refused: LoRA adapters are not supported"):
        EngineArgs(model="m", enable_lora=True)
    with pytest.raises(ValueError, match="unknown engine argument 'max_model_length'; did you mean 'max_model_len'"):
        EngineArgs(max_model_length=8)
    with pytest.raises(ValueError, match="given twice"):
        EngineArgs(block_size=8, kvcache_block_size=8)
    args = EngineArgs(model="m", block_size=32, enable_lora=False, disable_custom_all_reduce=True)
    assert args.kvcache_block_size == 32
    assert dataclasses.replace(args, seed=3).seed == 3 and dataclasses.replace(args, seed=3).kvcache_block_size == 32
    assert EngineArgs(**dataclasses.asdict(args)) == args


def test_add_cli_args_returns_the_parser_and_async_engine_args_is_there():
    from nanokv.engine.arg_utils import AsyncEngineArgs
    from nanokv.utils import FlexibleArgumentParser

    assert AsyncEngineArgs is EngineArgs
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert isinstance(parser, argparse.ArgumentParser)
    group = argparse.ArgumentParser().add_argument_group("Engine arguments")
    assert EngineArgs.add_cli_args(group) is group
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--max-model-len", "64", "--enforce-eager"]))
    assert (args.model, args.max_model_len, args.enforce_eager) == ("m", 64, True)


def test_max_logprobs_minus_one_means_no_cap(model_dir):
    llm = LLM(model_dir, max_model_len=64, kv_cache_memory_bytes=1 << 20, max_logprobs=-1)
    vocab = llm.model_config.get_vocab_size()
    (out,) = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=1, logprobs=40), use_tqdm=False)
    assert len(out.outputs[0].logprobs[0]) >= 40
    (out,) = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=1, logprobs=-1), use_tqdm=False)
    assert len(out.outputs[0].logprobs[0]) == vocab
    llm.close()
    with pytest.raises(ValueError, match="max_logprobs must be an int >= -1"):
        LLM(model_dir, max_logprobs=-2)


def test_profiling_writes_a_trace_to_the_vllm_directory(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("NANOKV_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="set VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate("Hello", GREEDY, use_tqdm=False)
    llm.stop_profile()
    (trace,) = os.listdir(tmp_path / "traces")
    assert trace.endswith(".pt.trace.json.gz") and os.path.getsize(tmp_path / "traces" / trace) > 0


def test_apply_model_and_collective_rpc_reach_the_model(llm):
    import torch

    (params,) = llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
    assert params == sum(p.numel() for p in llm.llm_engine.runner.model.parameters()) > 0
    assert llm.collective_rpc(lambda runner, k, scale=1: k * scale, args=(3,), kwargs={"scale": 2}) == [6]
    assert isinstance(llm.apply_model(lambda model: model)[0], torch.nn.Module)
    with pytest.raises(ValueError, match="no method 'no_such_method'"):
        llm.collective_rpc("no_such_method")
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serves


def test_sleep_mode_is_refused_by_name(llm):
    for call in (lambda: llm.sleep(level=1), llm.wake_up):
        with pytest.raises(NotImplementedError, match=r"sleep mode \(sleep / wake_up\) is not supported by nanokv"):
            call()


@pytest.mark.parametrize("statement, topic", [
    ("from nanokv.pooling_params import PoolingParams", "pooling models"),
    ("from nanokv.beam_search import BeamSearchOutput", "beam search"),
    ("import nanokv.pooling_params", "pooling models"),
])
def test_vllm_module_paths_of_unsupported_features_name_them(statement, topic):
    with pytest.raises(ImportError, match="not supported") as e:
        exec(statement, {})
    assert topic in str(e.value) and not isinstance(e.value, ModuleNotFoundError)


def test_vllm_module_paths_scripts_import():
    from nanokv.logprobs import Logprob
    from nanokv.metrics import reader
    from nanokv.outputs import Logprob as OutputsLogprob
    from nanokv.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    assert Logprob is OutputsLogprob
    assert (Counter, Gauge, Histogram, Vector) == (reader.Counter, reader.Gauge, reader.Histogram, reader.Vector)


def test_v0_beam_search_fields_are_refused_by_name_when_on():
    with pytest.raises(ValueError, match="use_beam_search=True: beam search is not supported"):
        SamplingParams(use_beam_search=True)
    with pytest.raises(ValueError, match="length_penalty=0.5: beam search"):
        SamplingParams(length_penalty=0.5)
    assert SamplingParams(use_beam_search=False, length_penalty=1.0, early_stopping=False) == SamplingParams()


def test_llm_logs_no_kv_summary_by_default(llm, caplog):
    with caplog.at_level(logging.INFO, logger="nanokv"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    assert not any("KV cache:" in r.getMessage() for r in caplog.records)


def test_prompt_token_ids_may_be_the_tokenizers_batch_encoding(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    encoded = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert not isinstance(encoded, list)  # a BatchEncoding (also what apply_chat_template(tokenize=True) gives)
    (out,) = llm.generate({"prompt_token_ids": encoded}, GREEDY, use_tqdm=False)
    (ref,) = llm.generate({"prompt_token_ids": list(encoded.input_ids)}, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ref.prompt_token_ids and out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_async_llm_has_vllms_engine_client_names(model_dir):
    import asyncio

    from nanokv.engine.types import EngineDeadError
    from nanokv.v1.engine.async_llm import AsyncLLM
    from nanokv.v1.engine.llm_engine import LLMEngine

    from nanokv import AsyncLLMEngine, LLMEngine as TopLLMEngine

    assert AsyncLLM is AsyncLLMEngine and LLMEngine is TopLLMEngine
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, max_model_len=64, kv_cache_memory_bytes=1 << 20))

    async def main():
        assert engine.model_config is engine.engine.model_config and engine.vllm_config is engine.engine.vllm_config
        assert (await engine.get_model_config()).max_model_len == 64
        assert (await engine.get_vllm_config()).cache_config.block_size == 16
        assert await engine.get_supported_tasks() == ("generate",)
        async for _ in engine.generate([5, 6, 7], GREEDY, "r"):
            pass
        await engine.check_health()
        assert engine.is_running and not engine.errored
        engine.shutdown()
        assert engine.errored and not engine.is_running and isinstance(engine.dead_error, EngineDeadError)
        try:
            await engine.check_health()
        except EngineDeadError:
            return True
        return False

    assert asyncio.run(main())


def test_lora_sizing_and_request_logging_arguments_are_accepted_without_effect(caplog):
    with caplog.at_level(logging.INFO, logger="nanokv"):
        args = EngineArgs(model="m", max_lora_rank=64, max_loras=2, disable_log_requests=True,
                          guided_decoding_backend="xgrammar")
    assert args.model == "m"
    assert any("max_lora_rank=64: no effect here: LoRA adapters are not supported" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="enable_lora=True is refused: LoRA"):  # the LoRA switch itself
        EngineArgs(max_lora_rank=64, enable_lora=True)


def test_outputs_carry_vllms_fields_for_what_nanokv_does_not_do(llm):
    (out,) = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params) == \
        (None,) * 4
    assert out.outputs[0].lora_request is None


def test_engine_do_log_stats_logs_the_kv_summary(llm, caplog):
    with caplog.at_level(logging.INFO, logger="nanokv"):
        llm.llm_engine.do_log_stats()
    assert any("KV cache:" in r.getMessage() for r in caplog.records)
