"""Generation defaults like vLLM: the model's generation_config.json fills every sampling
field a request leaves unset (LLM.generate(None), the server, `nanokv generate`);
generation_config='vllm' turns it off; an explicit value always wins."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil

import pytest

from nanokv import LLM, SamplingParams
from nanokv.entrypoints.cli import main
from nanokv.entrypoints.openai.protocol import APIError, Limits, parse_chat, parse_completion
from nanokv.entrypoints.openai.settings import ServerSettings
from nanokv.llm import render_chat

SETTINGS = ServerSettings(model_names=("m",))  # the server settings the parsers read (the model names)

SMALL = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256)
SAMPLED = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 7,
           "do_sample": True}


@pytest.fixture(scope="module")
def with_generation_config(checkpoint, tmp_path_factory):
    """with_generation_config(**fields) -> a copy of the tiny checkpoint whose
    generation_config.json also holds `fields`."""
    def make(**fields) -> str:
        out = tmp_path_factory.mktemp("generation-config")
        shutil.copytree(checkpoint("qwen3-tiny"), out, dirs_exist_ok=True)
        path = out / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
        return str(out)

    return make


@pytest.fixture(scope="module")
def sampled_dir(with_generation_config):
    return with_generation_config(**SAMPLED)


@pytest.fixture(scope="module")
def sampled_llm(sampled_dir):
    return LLM(sampled_dir, **SMALL)


def test_the_model_generation_config_is_the_default(sampled_llm, model_dir):
    d = sampled_llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.max_tokens) == (0.6, 20, 0.9, 1.1, 7)
    assert dataclasses.replace(d, temperature=1.0, top_k=-1, top_p=1.0, repetition_penalty=1.0,
                               max_tokens=16) == SamplingParams()  # nothing else moved
    assert sampled_llm.llm_engine.get_default_sampling_params() == d
    # None: the model's defaults (7 tokens); an explicit SamplingParams is used as given
    out = sampled_llm.generate(["Hello there", [5, 6, 7]], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [7, 7]
    chat = sampled_llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 7
    assert len("".join(sampled_llm.stream("Hello there"))) > 0
    given = sampled_llm.generate("Hello there", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 3
    # a model without sampling fields in its file: SamplingParams() (vLLM's answer too)
    assert LLM(model_dir, **SMALL).get_default_sampling_params() == SamplingParams()


def test_vllm_turns_it_off_and_a_directory_or_overrides_replace_it(sampled_dir, model_dir):
    assert LLM(sampled_dir, generation_config="vllm", **SMALL).get_default_sampling_params() == SamplingParams()
    d = LLM(model_dir, generation_config=sampled_dir, **SMALL).get_default_sampling_params()
    assert (d.temperature, d.max_tokens) == (0.6, 7)
    d = LLM(sampled_dir, override_generation_config={"temperature": 0.2, "max_new_tokens": 4},
            **SMALL).get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (0.2, 20, 4)
    d = LLM(sampled_dir, generation_config="vllm", override_generation_config={"top_k": 5},
            **SMALL).get_default_sampling_params()
    assert d == SamplingParams(top_k=5)


def test_bad_generation_configs_are_refused(with_generation_config, model_dir, tmp_path):
    with pytest.raises(ValueError, match="generation_config='vllm'"):
        LLM(with_generation_config(temperature=-1), **SMALL)
    with pytest.raises(ValueError, match="not a directory"):
        LLM(model_dir, generation_config=str(tmp_path / "missing"), **SMALL)
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        LLM(model_dir, generation_config=str(tmp_path), **SMALL)


def test_the_server_fills_only_the_fields_a_request_leaves_unset(sampled_llm):
    defaults = sampled_llm.llm_engine.config.default_sampling_params
    limits = Limits.of(sampled_llm.get_tokenizer(), 256)
    unset = parse_completion({"prompt": "Hi"}, SETTINGS, limits, defaults).params
    assert (unset.temperature, unset.top_k, unset.top_p, unset.repetition_penalty, unset.max_tokens) == \
        (0.6, 20, 0.9, 1.1, 7)
    given = parse_completion({"prompt": "Hi", "temperature": 0, "max_tokens": 3, "top_k": None}, SETTINGS, limits,
                             defaults).params
    assert (given.temperature, given.top_k, given.max_tokens) == (0, 20, 3)  # null counts as unset
    assert parse_completion({"prompt": "Hi"}, SETTINGS, limits).params.max_tokens == 16  # no defaults: OpenAI's
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    params = parse_chat(chat, SETTINGS, sampled_llm.get_tokenizer(), limits, defaults).params
    assert (params.temperature, params.max_tokens) == (0.6, 7)
    params = parse_chat({**chat, "max_completion_tokens": 2, "temperature": 1.5}, SETTINGS,
                        sampled_llm.get_tokenizer(), limits, defaults).params
    assert (params.temperature, params.top_p, params.max_tokens) == (1.5, 0.9, 2)
    assert parse_chat(chat, SETTINGS, sampled_llm.get_tokenizer(), limits).params.max_tokens is None
    # a default above max_model_len is no request for that many (an explicit one is a 400)
    big = {**defaults, "max_tokens": 5000}
    assert parse_completion({"prompt": "Hi"}, SETTINGS, limits, big).params.max_tokens == 256
    assert parse_chat(chat, SETTINGS, sampled_llm.get_tokenizer(), limits, big).params.max_tokens == 256
    with pytest.raises(APIError, match="more than max_model_len"):
        parse_completion({"prompt": "Hi", "max_tokens": 5000}, SETTINGS, limits, defaults)


def test_the_server_app_applies_the_defaults_and_logs_them(sampled_llm, caplog):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from nanokv.async_llm import AsyncLLM
    from nanokv.entrypoints.openai.api_server import ServerSettings, build_app
    from nanokv.llm_engine import LLMEngine

    engine = LLMEngine(sampled_llm.llm_engine.config, tokenizer=sampled_llm.get_tokenizer())
    llm = AsyncLLM(engine)
    with caplog.at_level(logging.INFO, logger="nanokv"):
        app = build_app(llm, ServerSettings(model_names=("tiny",)))
    assert "Using default sampling params from model generation config: {'temperature': 0.6" in caplog.text

    async def main():
        llm.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            unset = await http.post("/v1/completions", json={"prompt": "Hi", "ignore_eos": True})
            given = await http.post("/v1/completions", json={"prompt": "Hi", "ignore_eos": True, "max_tokens": 3})
        await asyncio.to_thread(llm.shutdown)
        return unset, given

    unset, given = asyncio.run(asyncio.wait_for(main(), 120))
    assert unset.status_code == 200 and unset.json()["usage"]["completion_tokens"] == 7
    assert given.status_code == 200 and given.json()["usage"]["completion_tokens"] == 3


def test_nanokv_generate_flags_not_given_take_the_model_defaults(with_generation_config, tmp_path):
    greedy_dir = with_generation_config(temperature=0, max_new_tokens=7)
    llm = LLM(greedy_dir, max_model_len=256)
    rows = [{"id": "a", "prompt": "Hello there"}, {"id": "b", "messages": [{"role": "user", "content": "Hi"}]},
            {"id": "c", "prompt": "Readability counts.", "sampling_params": {"max_tokens": 2}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(name: str, *flags: str) -> dict:
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--model", greedy_dir, "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                     "--max-model-len", "256", "--no-progress", *flags]) == 0
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    prompts = ["Hello there", render_chat(llm.get_tokenizer(), rows[1]["messages"]), "Readability counts."]
    greedy = SamplingParams(temperature=0, max_tokens=7)
    expected = llm.generate(prompts, [greedy, greedy, SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
    records = run("defaults")
    for row, out in zip(rows, expected):
        assert records[row["id"]]["token_ids"] == out.outputs[0].token_ids, row["id"]
    assert len(expected[0].outputs[0].token_ids) == 7  # the model's max_new_tokens, not SamplingParams' 16
    records = run("flags", "--max-tokens", "3")  # a flag given wins; a line's sampling_params win over both
    assert [records[r]["num_completion_tokens"] for r in "abc"] == \
        [min(3, len(expected[0].outputs[0].token_ids)), min(3, len(expected[1].outputs[0].token_ids)), 2]
    records = run("vllm", "--generation-config", "vllm", "--temperature", "0")  # SamplingParams' 16 tokens
    assert records["a"]["token_ids"][:7] == expected[0].outputs[0].token_ids
    assert records["a"]["num_completion_tokens"] > 7 or records["a"]["finish_reason"] == "stop"
