"""vLLM's Python API on nanokv: a ported vLLM offline script (written from vLLM's
documented API: the quickstart and the offline-inference examples) runs to the end on
the real SmolLM2, and each vLLM name and behaviour it leans on works as in vLLM, or fails
with a message naming what is not supported."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest

import nanokv
from nanokv import LLM, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt

from .conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8)
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


# ---- the ported script ------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    llm = LLM(model="smollm2", kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    yield llm
    llm.close()


def test_a_ported_vllm_offline_script_runs_to_the_end(smollm2):
    # the script as a vLLM user writes it; only the import changed
    from nanokv import CompletionOutput, EngineArgs, LLMEngine, RequestOutput  # noqa: F401

    llm = smollm2
    # quickstart
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        assert isinstance(output, RequestOutput) and isinstance(output.outputs[0], CompletionOutput)
        assert isinstance(output.prompt, str) and isinstance(output.outputs[0].text, str)
        assert len(output.outputs[0].token_ids) <= 16  # vLLM's default max_tokens
    assert [o.prompt for o in outputs] == prompts

    # greedy, and the three prompt forms giving the same tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    (text_out,) = llm.generate("The capital of France is", greedy, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The capital of France is")
    assert text_out.prompt_token_ids == ids
    forms = llm.generate([TextPrompt(prompt="The capital of France is"), TokensPrompt(prompt_token_ids=ids)],
                         greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in forms] == [text_out.outputs[0].token_ids] * 2
    assert "Paris" in text_out.outputs[0].text

    # several samples with logprobs, stop strings, per-prompt params
    params = SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=6, logprobs=3)
    (sampled,) = llm.generate(prompts[0], params, use_tqdm=False)
    assert [c.index for c in sampled.outputs] == [0, 1]
    for c in sampled.outputs:
        assert len(c.logprobs) == len(c.token_ids) and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-3)
    stopped = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=12, stop=["."]), use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == "."

    # chat, with string content and with OpenAI content parts (the same prompt)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    chat_params = SamplingParams(temperature=0, max_tokens=10)
    (chat,) = llm.chat(conversation, chat_params, use_tqdm=False)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conversation]
    (chat_parts,) = llm.chat(parts, chat_params, use_tqdm=False)
    assert chat_parts.prompt_token_ids == chat.prompt_token_ids
    assert chat_parts.outputs[0].token_ids == chat.outputs[0].token_ids and chat.outputs[0].text
    batch = llm.chat([conversation, conversation[:2]], chat_params, use_tqdm=False,
                     chat_template_kwargs={"enable_thinking": False})
    assert batch[0].outputs[0].token_ids == chat.outputs[0].token_ids

    # tokenizer and prefix cache
    assert llm.llm_engine.get_tokenizer() is tokenizer
    assert llm.reset_prefix_cache() is True

    # the LLMEngine step loop (vLLM's argument order; cumulative outputs by default)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy)
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for request_output in engine.step():
            if request_output.finished:
                finished[request_output.request_id] = request_output
    assert not engine.has_unfinished_requests()
    reference = llm.generate(prompts, greedy, use_tqdm=False)
    assert [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))] == \
        [o.outputs[0].token_ids for o in reference]
    assert [finished[str(i)].outputs[0].text for i in range(len(prompts))] == [o.outputs[0].text for o in reference]


# ---- imports -------------------------------------------------------------------------------

def test_vllm_top_level_names_are_nanokv_objects():
    from nanokv import AsyncEngineArgs, AsyncLLMEngine, CompletionOutput, EngineArgs, LLMEngine, RequestOutput
    from nanokv.async_llm import AsyncLLM
    from nanokv.engine.arg_utils import EngineArgs as Args
    from nanokv.inputs import TextPrompt as InputsText, TokensPrompt as InputsTokens
    from nanokv.llm_engine import LLMEngine as Engine
    from nanokv.outputs import CompletionOutput as Completion, RequestOutput as Request
    from nanokv.sampling_params import RequestOutputKind as Kind

    assert LLMEngine is Engine and AsyncLLMEngine is AsyncLLM and AsyncEngineArgs is EngineArgs is Args
    assert (RequestOutput, CompletionOutput) == (Request, Completion)
    assert (TextPrompt, TokensPrompt, RequestOutputKind) == (InputsText, InputsTokens, Kind)
    assert [k.value for k in (CUMULATIVE, DELTA, FINAL_ONLY)] == [0, 1, 2]  # vLLM's values
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}  # plain dicts
    assert set(nanokv.__all__) >= {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TokensPrompt",
                                   "TextPrompt", "EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLMEngine"}


def test_importing_nanokv_and_its_vllm_leaves_imports_no_torch():
    code = ("import sys, nanokv, nanokv.inputs, nanokv.outputs, nanokv.sampling_params\n"
            "from nanokv import SamplingParams, TokensPrompt, TextPrompt, RequestOutput, CompletionOutput\n"
            "assert not hasattr(nanokv, 'LoRARequest')\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("statement, topic", [
    ("from nanokv import LoRARequest", "LoRA"),
    ("from nanokv.lora.request import LoRARequest", "LoRA"),
    ("from nanokv import PoolingParams", "pooling"),
    ("from nanokv import EmbeddingRequestOutput", "pooling"),
    ("from nanokv.outputs import PoolingRequestOutput", "pooling"),
    ("from nanokv.outputs import ClassificationRequestOutput, ScoringRequestOutput", "pooling"),
    ("from nanokv import BeamSearchParams", "beam search"),
    ("from nanokv.sampling_params import BeamSearchParams", "beam search"),
    ("from nanokv.inputs import EmbedsPrompt", "prompt embeddings"),
])
def test_unsupported_vllm_names_fail_with_the_reason(statement, topic):
    with pytest.raises(ImportError, match="not supported") as e:
        exec(statement, {})
    assert topic in str(e.value)


def test_unsupported_names_read_as_attributes_raise_attribute_error_with_the_reason():
    with pytest.raises(AttributeError, match="LoRA adapters are not supported by nanokv; merge"):
        nanokv.LoRARequest  # noqa: B018
    with pytest.raises(AttributeError, match="beam search is not supported"):
        nanokv.sampling_params.BeamSearchParams  # noqa: B018
    # hasattr and getattr with a default see a missing name, not an error
    assert not hasattr(nanokv, "PoolingParams") and getattr(nanokv.outputs, "PoolingRequestOutput", 7) == 7
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        nanokv.NoSuchName  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'NoSuchName'"):
        exec("from nanokv import NoSuchName", {})


def test_llm_pooling_beam_search_and_lora_are_refused_by_name(llm):
    for method in ("embed", "encode", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match="pooling models .* are not supported by nanokv"):
            getattr(llm, method)(["Hello"])
    with pytest.raises(NotImplementedError, match="beam search is not supported by nanokv"):
        llm.beam_search(["Hello"], None)
    with pytest.raises(ValueError, match="lora_request: LoRA adapters are not supported"):
        llm.generate("Hello", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.llm_engine.add_request("x", "Hello", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="priority scheduling is not supported"):
        llm.generate(["a", "b"], GREEDY, priority=[0, 1])
    with pytest.raises(ValueError, match="multi-modal inputs are not supported"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {"image": object()}}, GREEDY)
    with pytest.raises(ValueError, match="cache_salt is not supported"):
        llm.generate({"prompt": "Hi", "cache_salt": "user-1"}, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    # off values are fine
    assert len(llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=None, priority=[0, 0])) == 2


# ---- SamplingParams ---------------------------------------------------------------------------

def test_unknown_sampling_field_names_the_closest():
    with pytest.raises(ValueError, match="SamplingParams has no field 'max_token'; did you mean 'max_tokens'"):
        SamplingParams(max_token=5)
    with pytest.raises(ValueError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="no field 'beam_width'; see help"):
        SamplingParams(beam_width=4)


@pytest.mark.parametrize("name, value", [
    ("logits_processors", [print]),
])
def test_constraint_fields_are_refused_by_name_until_implemented(name, value):
    with pytest.raises(ValueError, match=f"^{name} is not supported yet by nanokv"):
        SamplingParams(**{name: value})
    assert SamplingParams(**{name: None}) == SamplingParams()  # vLLM's "off" value


def test_best_of_only_as_n():
    assert SamplingParams(n=2, best_of=2) == SamplingParams(n=2)
    with pytest.raises(ValueError, match="best_of=3 is not supported"):
        SamplingParams(n=1, best_of=3)


def test_from_optional_clone_and_extra_args():
    params = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                          frequency_penalty=None, repetition_penalty=None, max_tokens=None,
                                          seed=None, stop=None, logprobs=None)
    default = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.repetition_penalty) == \
        (default.n, default.temperature, default.top_p, default.repetition_penalty)
    assert params.max_tokens is None  # None is a value of its own there, as in vLLM
    assert SamplingParams.from_optional(temperature=0.5, top_k=None).temperature == 0.5
    original = SamplingParams(stop=["a"], extra_args={"trace": [1]})
    copy = original.clone()
    copy.stop.append("b")
    copy.extra_args["trace"].append(2)
    assert original.stop == ["a"] and original.extra_args == {"trace": [1]} and copy is not original
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_logprobs_minus_one_is_the_whole_vocabulary(model_dir, llm):
    with pytest.raises(ValueError, match=r"logprobs=-1 asks for the whole vocabulary \(1024 tokens\) but "
                                         r"max_logprobs is 20"):
        llm.generate("Hello", SamplingParams(logprobs=-1))
    everything = LLM(model_dir, max_model_len=256, max_logprobs=1024)
    try:
        (out,) = everything.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=-1),
                                     use_tqdm=False)
        (top,) = everything.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=2),
                                     use_tqdm=False)
    finally:
        everything.close()
    c = out.outputs[0]
    assert c.token_ids == top.outputs[0].token_ids
    assert [len(lp) for lp in c.logprobs] == [1024] * 3
    for lp, small in zip(c.logprobs, top.outputs[0].logprobs):
        assert sorted(e.rank for e in lp.values()) == list(range(1, 1025))
        for tid, e in small.items():
            assert lp[tid].logprob == pytest.approx(e.logprob, abs=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = random_prompts([40], 1024, seed=3)[0]
    (out,) = llm.generate(prompt, dataclasses.replace(GREEDY, truncate_prompt_tokens=10), use_tqdm=False)
    (direct,) = llm.generate(prompt[-10:], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == prompt[-10:]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    max_len = llm.llm_engine.config.max_model_len
    long = random_prompts([max_len + 20], 1024, seed=4)[0]
    (fit,) = llm.generate(long, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=-1),
                          use_tqdm=False)
    assert fit.prompt_token_ids == long[-(max_len - 1):] and len(fit.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens={max_len + 1} is more than max_model_len"):
        llm.generate(prompt, SamplingParams(truncate_prompt_tokens=max_len + 1))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an int >= 1 or -1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_detokenize_false_gives_token_ids_only(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (text,) = llm.generate("Hello there", params, use_tqdm=False)
    (ids,) = llm.generate("Hello there", dataclasses.replace(params, detokenize=False), use_tqdm=False)
    assert text.outputs[0].text and ids.outputs[0].text == ""
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert all(e.decoded_token is None for lp in ids.outputs[0].logprobs for e in lp.values())
    engine = llm.llm_engine
    rid = engine.add_request("Hello there", dataclasses.replace(params, detokenize=False), stream=True)
    deltas = []
    for _ in range(100):
        if not engine.has_request(rid):
            break
        deltas += [c for out in engine.step() for c in out.outputs]
    assert [c.text for c in deltas] == [""] * len(deltas)
    assert sum((c.token_ids for c in deltas), []) == text.outputs[0].token_ids
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)


class RecordingTokenizer:
    """The real tokenizer, recording the keyword arguments of every decode()."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decode_kwargs = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def decode(self, ids, **kwargs):
        self.decode_kwargs.append(kwargs)
        return self.tokenizer.decode(ids, **kwargs)


def test_set_tokenizer_and_spaces_between_special_tokens_reach_decode(llm):
    original = llm.get_tokenizer()
    recording = RecordingTokenizer(original)
    llm.set_tokenizer(recording)
    try:
        assert llm.get_tokenizer() is recording and llm.llm_engine.get_tokenizer() is recording
        off = SamplingParams(temperature=0, max_tokens=4, spaces_between_special_tokens=False)
        llm.generate("Hello", off, use_tqdm=False)  # the final text
        list(llm.stream("Hello", off))  # the incremental detokenizer
        assert len(recording.decode_kwargs) > 2
        assert all(k.get("spaces_between_special_tokens") is False for k in recording.decode_kwargs)
        recording.decode_kwargs.clear()
        llm.generate("Hello", GREEDY, use_tqdm=False)  # the default passes nothing new
        assert recording.decode_kwargs and all("spaces_between_special_tokens" not in k
                                               for k in recording.decode_kwargs)
    finally:
        llm.set_tokenizer(original)
    with pytest.raises(ValueError, match="set_tokenizer\\(\\) takes a tokenizer"):
        llm.set_tokenizer("gpt2")


def test_use_tqdm_takes_a_progress_bar_class(llm):
    made = []

    def bar(**kwargs):
        from tqdm.auto import tqdm

        made.append(kwargs["total"])
        return tqdm(**{**kwargs, "disable": True})

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=bar)
    assert made == [3]


# ---- the step API, vLLM's way --------------------------------------------------------------

def run_engine(engine, limit: int = 500) -> list:
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


def test_add_request_in_vllm_order_honours_output_kind(llm):
    engine = llm.llm_engine
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (ref,) = llm.generate(prompt, params, use_tqdm=False)
    ref = ref.outputs[0]
    engine.add_request("cum", prompt, params)  # CUMULATIVE: vLLM's default
    engine.add_request("delta", TextPrompt(prompt=prompt), dataclasses.replace(params, output_kind=DELTA))
    engine.add_request("final", prompt, dataclasses.replace(params, output_kind=FINAL_ONLY))
    outputs = run_engine(engine)
    by_id = {rid: [o for o in outputs if o.request_id == rid] for rid in ("cum", "delta", "final")}
    cum = [o.outputs[0] for o in by_id["cum"]]
    assert [len(c.token_ids) for c in cum] == list(range(1, 7))  # the whole output so far, each step
    assert all(a.token_ids == b.token_ids[:len(a.token_ids)] and b.text.startswith(a.text)
               for a, b in zip(cum, cum[1:]))
    assert (cum[-1].token_ids, cum[-1].text, by_id["cum"][-1].finished) == (ref.token_ids, ref.text, True)
    assert not any(o.finished for o in by_id["cum"][:-1])
    delta = [o.outputs[0] for o in by_id["delta"]]
    assert [len(c.token_ids) for c in delta] == [1] * 6
    assert (sum((c.token_ids for c in delta), []), "".join(c.text for c in delta)) == (ref.token_ids, ref.text)
    assert len(by_id["final"]) == 1 and by_id["final"][0].outputs[0].token_ids == ref.token_ids


def test_nanokv_order_still_returns_one_final_output(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    rid = engine.add_request("Hello", params)
    named = engine.add_request([5, 6, 7], params, request_id="mine")
    streamed = engine.add_request("Hello", dataclasses.replace(params, output_kind=DELTA))
    outputs = run_engine(engine)
    assert [o.request_id for o in outputs if o.request_id in (rid, named)].count(rid) == 1
    assert [o.finished for o in outputs if o.request_id in (rid, named)] == [True, True]
    assert len([o for o in outputs if o.request_id == streamed]) == 5  # DELTA asked for: one per token


def test_abort_request_and_counts(llm):
    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "Hello", long)
    engine.step()
    assert engine.get_num_unfinished_requests() == 3 and engine.has_unfinished_requests()
    engine.abort_request("a")
    engine.abort_request(["b", "c", "unknown"])
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    assert engine.kv_stats().used_blocks == 0
    with pytest.raises(ValueError, match="request_id is required"):
        engine.add_request(None, "Hello", long)


def test_from_engine_args_builds_an_llm_engine(model_dir):
    from nanokv import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, max_model_len=128))
    try:
        engine.add_request("0", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        outputs = run_engine(engine)
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
        assert engine.get_tokenizer() is engine.tokenizer
    finally:
        engine.close()
    with pytest.raises(ValueError, match="stat_loggers is not supported"):
        LLMEngine.from_engine_args(EngineArgs(model=model_dir), stat_loggers={})


def test_async_llm_generate_is_cumulative_by_default(llm, model_dir):
    from nanokv import AsyncEngineArgs, AsyncLLMEngine

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (ref,) = llm.generate("Hello there", params, use_tqdm=False)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir, max_model_len=128))

    async def collect(p, request_id):
        return [out async for out in engine.generate("Hello there", p, request_id)]

    async def main():
        try:
            return (await collect(params, "a"), await collect(dataclasses.replace(params, output_kind=FINAL_ONLY), "b"),
                    await collect(dataclasses.replace(params, output_kind=DELTA), "c"))
        finally:
            engine.shutdown()

    cumulative, final, delta = asyncio.run(asyncio.wait_for(main(), 120))
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5]
    assert cumulative[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert cumulative[-1].outputs[0].text == ref.outputs[0].text and cumulative[-1].finished
    assert len(final) == 1 and final[0].outputs[0].text == ref.outputs[0].text
    assert "".join(o.outputs[0].text for o in delta) == ref.outputs[0].text


# ---- LLM methods --------------------------------------------------------------------------------

def test_reset_prefix_cache(llm):
    prompt = random_prompts([65], 1024, seed=7)[0]  # four full blocks and one token
    llm.generate(prompt, GREEDY, use_tqdm=False)
    hits = llm.kv_stats().prefix_hit_tokens
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens == hits + 64  # cached: four 16-token blocks hit
    assert llm.reset_prefix_cache() is True
    assert llm.kv_stats().free_cached_blocks == 0
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens == hits + 64  # forgotten: no hit
    engine = llm.llm_engine
    engine.add_request("running", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False  # a request holds blocks: refused, as in vLLM
    engine.abort_request("running")
    assert llm.reset_prefix_cache() is True


def test_chat_content_parts_join_like_the_server(llm):
    from nanokv.entrypoints.openai.protocol import APIError, _messages

    tok = llm.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                          {"type": "text", "text": "a KV cache?"}]}]
    joined = [{"role": "user", "content": "What is\na KV cache?"}]
    (a,) = llm.chat(parts, GREEDY, use_tqdm=False)
    (b,) = llm.chat(joined, GREEDY, use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids == list(
        tok.apply_chat_template(joined, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert _messages(parts) == joined  # the server reads content through the same function
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\] has type 'image_url'; nanokv takes text only"):
        llm.chat(image, GREEDY)
    with pytest.raises(APIError, match=r"messages\[0\]\.content\[0\] has type 'image_url'; nanokv takes text only"):
        _messages(image)


def test_chat_template_arguments(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are"}]
    (cont,) = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("<|im_start|>assistant\nRoses are")  # the last message left open
    (closed,) = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt.endswith("Roses are<|im_end|>\n")
    (opened,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert opened.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="set add_generation_prompt=False"):
        llm.chat(conv, GREEDY, continue_final_message=True)
    template = "{{ greeting }}:{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ tools | length }}"
    (custom,) = llm.chat(conv[:1], GREEDY, use_tqdm=False, chat_template=template,
                         chat_template_kwargs={"greeting": "hey"}, tools=[{"type": "function"}])
    assert custom.prompt == "hey:Write a poem|1"
    assert custom.prompt_token_ids == tok("hey:Write a poem|1", add_special_tokens=False).input_ids
    openai = "{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "as parts"}]}]
    (raw,) = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=openai, chat_template_content_format="openai")
    assert raw.prompt == "as parts"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set 'tokenize'"):
        llm.chat(conv, GREEDY, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="mm_processor_kwargs: multi-modal inputs are not supported"):
        llm.chat(conv, GREEDY, mm_processor_kwargs={"size": 1})


def test_async_llm_takes_vllm_constructor_arguments_and_calls(model_dir):
    from nanokv import AsyncEngineArgs, AsyncLLMEngine
    from nanokv.utils import random_uuid

    with pytest.raises(ValueError, match="stat_loggers .* is not supported"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir), stat_loggers=[])
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir, max_model_len=128),
                                             start_engine_loop=True, usage_context=None)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        try:
            request_id = random_uuid()
            gen = engine.generate("Hello", long, request_id)
            first = await gen.__anext__()
            await engine.abort(request_id)  # one id, awaited, as vLLM takes it
            rest = [out async for out in gen]
            tokenizer = await engine.get_tokenizer()
            assert await engine.reset_prefix_cache() is True  # the aborted request's blocks are free
            return first, rest, await engine.snapshot(), tokenizer
        finally:
            engine.shutdown()

    first, rest, snap, tokenizer = asyncio.run(asyncio.wait_for(main(), 120))
    assert tokenizer is engine.tokenizer and snap.kv.free_cached_blocks == 0
    # the generator ends: what had arrived before the abort, then nothing more
    assert len(first.outputs[0].token_ids) >= 1 and not any(o.finished for o in rest)
    assert all(len(o.outputs[0].token_ids) < 100 for o in rest)
    assert (snap.num_running, snap.kv.used_blocks) == (0, 0)
