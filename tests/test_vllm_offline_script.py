"""A vLLM user's offline script, ported by changing only the import (vllm -> nanokv).

Written from vLLM's documentation and examples (the quickstart, examples/offline_inference:
basic/generate.py, basic/chat.py, llm_engine_example.py, automatic_prefix_caching.py,
metrics.py, simple_profiling.py; the LLM, SamplingParams and RequestOutput references), on
the real SmolLM2 with a small KV pool. Every call runs in a harness that records whether it
worked, was refused as expected (LoRA, pooling, beam search: the error must name the
feature and say it is not supported), or was refused by name though not excluded (the
constraint fields and prompt_logprobs, which issue 29 defers; sleep mode); those count as
failing in the tally. The test asserts each call's outcome and prints
the tally (pytest -s shows it).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import pickle
import re
import traceback


OK, REFUSED, UNSUPPORTED = "ok", "refused", "unsupported"

# what a refusal's message must name
LORA, POOLING, BEAM = r"LoRA", r"pooling", r"beam search"


class Harness:
    """Runs each call, records its outcome; ns holds the values later calls use."""

    def __init__(self):
        self.results: list[tuple[str, str, str, str]] = []  # (name, expected, got, detail)
        self.ns: dict = {}

    def call(self, name: str, fn, check=None, *, keep: str | None = None, expect: str = OK,
             names: str | None = None):
        """fn() is the call; check(value) its expected result (an assert); keep stores the
        value in ns. expect REFUSED (LoRA, pooling, beam search: excluded from the count) or
        UNSUPPORTED (refused by name, counted as failing): the call must raise an error whose
        message matches `names` (the feature) and says "not supported"."""
        try:
            value = fn()
            if check is not None:
                check(value)
        except Exception as e:  # noqa: BLE001 - every failure is recorded
            message = f"{type(e).__name__}: {e}"
            if expect != OK and re.search(names, str(e)) and "not supported" in str(e):
                got = expect
            else:
                got = "failed"
                if expect == OK:
                    message += "\n" + "".join(traceback.format_exception(e)[-3:])
            self.results.append((name, expect, got, message))
            return None
        if keep is not None:
            self.ns[keep] = value
        self.results.append((name, expect, OK if expect == OK else "failed",
                             "" if expect == OK else f"no error (expected one naming {names!r})"))
        return value

    async def acall(self, name: str, fn, check=None, **kwargs):
        """call() for a coroutine: fn() returns an awaitable, awaited here."""
        holder = []

        async def run():
            holder.append(await fn())

        try:
            await run()
        except Exception as e:  # noqa: BLE001 - recorded through call()
            error = e

            def value():
                raise error
        else:
            def value():
                return holder[0]
        return self.call(name, value, check, **kwargs)

    def tally(self) -> dict[str, int]:
        got = [r[2] for r in self.results]
        return {"calls": len(got), "passed": got.count(OK), "refused as expected": got.count(REFUSED),
                "refused by name (unsupported)": got.count(UNSUPPORTED), "failed": got.count("failed")}


def test_a_vllm_offline_script_with_only_the_import_changed(smollm2_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "profile"))
    h = Harness()
    try:
        run_script(h, tmp_path)
    finally:  # the tally so far, also when a call the rest needs (building the LLM) failed
        tally = h.tally()
        with capsys.disabled():
            print("\nvLLM offline script on nanokv:", ", ".join(f"{k} {v}" for k, v in tally.items()))
            for name, expected, got, detail in h.results:
                if got != OK:
                    print(f"  [{got}{'' if got == expected else ', expected ' + expected}] {name}: "
                          f"{detail.splitlines()[0][:200] if detail else ''}")
    unexpected = [(name, expected, got, detail) for name, expected, got, detail in h.results if got != expected]
    assert not unexpected, "\n".join(f"{n}: expected {e}, got {g}: {d}" for n, e, g, d in unexpected)
    assert tally["calls"] >= 140
    assert tally["passed"] + tally["refused as expected"] >= 0.95 * tally["calls"]


# ---- the script ---------------------------------------------------------------------------

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
SMALL = dict(kv_cache_memory_bytes=64 << 20, max_model_len=1024)


def run_script(h: Harness, tmp_path) -> None:  # noqa: PLR0915 - a script, call after call
    ns = h.ns
    c = h.call

    # ---- imports ----------------------------------------------------------------------------
    def imp(statement):
        exec(statement, ns)
        return True

    c("from vllm import LLM, SamplingParams", lambda: imp("from nanokv import LLM, SamplingParams"))
    c("from vllm import RequestOutput, CompletionOutput",
      lambda: imp("from nanokv import RequestOutput, CompletionOutput"))
    c("from vllm import EngineArgs, LLMEngine", lambda: imp("from nanokv import EngineArgs, LLMEngine"))
    c("from vllm import AsyncEngineArgs, AsyncLLMEngine",
      lambda: imp("from nanokv import AsyncEngineArgs, AsyncLLMEngine"))
    c("from vllm import TokensPrompt, TextPrompt", lambda: imp("from nanokv import TokensPrompt, TextPrompt"))
    c("from vllm.inputs import TokensPrompt, TextPrompt",
      lambda: imp("from nanokv.inputs import TokensPrompt, TextPrompt"))
    c("from vllm.sampling_params import RequestOutputKind",
      lambda: imp("from nanokv.sampling_params import RequestOutputKind, SamplingParams"))
    c("from vllm.outputs import RequestOutput, CompletionOutput",
      lambda: imp("from nanokv.outputs import RequestOutput, CompletionOutput"))
    c("from vllm.engine.arg_utils import EngineArgs, AsyncEngineArgs",
      lambda: imp("from nanokv.engine.arg_utils import EngineArgs, AsyncEngineArgs"))
    c("from vllm.utils import random_uuid", lambda: imp("from nanokv.utils import random_uuid"))
    c("from vllm.utils import FlexibleArgumentParser", lambda: imp("from nanokv.utils import FlexibleArgumentParser"))
    c("from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector",
      lambda: imp("from nanokv.v1.metrics.reader import Counter, Gauge, Histogram, Vector"))
    c("from vllm.logprobs import Logprob", lambda: imp("from nanokv.logprobs import Logprob"))
    c("from vllm.v1.engine.async_llm import AsyncLLM", lambda: imp("from nanokv.v1.engine.async_llm import AsyncLLM"))
    c("from vllm.v1.engine.llm_engine import LLMEngine",
      lambda: imp("from nanokv.v1.engine.llm_engine import LLMEngine as V1LLMEngine"))
    c("vllm.__version__", lambda: imp("import nanokv; assert isinstance(nanokv.__version__, str)"))
    c("from vllm.lora.request import LoRARequest", lambda: imp("from nanokv.lora.request import LoRARequest"),
      expect=REFUSED, names=LORA)
    c("from vllm import LoRARequest", lambda: imp("from nanokv import LoRARequest"), expect=REFUSED, names=LORA)
    c("from vllm.pooling_params import PoolingParams", lambda: imp("from nanokv.pooling_params import PoolingParams"),
      expect=REFUSED, names=POOLING)
    c("from vllm import PoolingParams", lambda: imp("from nanokv import PoolingParams"), expect=REFUSED,
      names=POOLING)
    c("from vllm.outputs import EmbeddingRequestOutput",
      lambda: imp("from nanokv.outputs import EmbeddingRequestOutput"), expect=REFUSED, names=POOLING)
    c("from vllm.sampling_params import BeamSearchParams",
      lambda: imp("from nanokv.sampling_params import BeamSearchParams"), expect=REFUSED, names=BEAM)
    c("from vllm.beam_search import BeamSearchOutput", lambda: imp("from nanokv.beam_search import BeamSearchOutput"),
      expect=REFUSED, names=BEAM)
    c("from vllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams",
      lambda: imp("from nanokv.sampling_params import GuidedDecodingParams, StructuredOutputsParams"))
    LLM, SamplingParams = ns["LLM"], ns["SamplingParams"]
    EngineArgs, LLMEngine = ns["EngineArgs"], ns["LLMEngine"]
    TokensPrompt, TextPrompt, RequestOutputKind = ns["TokensPrompt"], ns["TextPrompt"], ns["RequestOutputKind"]
    RequestOutput, CompletionOutput = ns["RequestOutput"], ns["CompletionOutput"]

    # ---- engine arguments refused before anything loads ------------------------------------
    c("LLM(model, enable_lora=True)", lambda: LLM("smollm2", enable_lora=True, **SMALL), expect=REFUSED, names=LORA)
    c("LLM(model, max_lora_rank=64, max_loras=4, enable_lora=True)",
      lambda: LLM("smollm2", max_lora_rank=64, max_loras=4, enable_lora=True, **SMALL), expect=REFUSED, names=LORA)
    c("LLM(model, task='embed')", lambda: LLM("smollm2", task="embed", **SMALL), expect=REFUSED, names=POOLING)
    c("LLM(model, runner='pooling')", lambda: LLM("smollm2", runner="pooling", **SMALL), expect=REFUSED,
      names=POOLING)
    c("EngineArgs(model, enable_lora=True)", lambda: EngineArgs(model="smollm2", enable_lora=True),
      expect=REFUSED, names=LORA)

    # ---- the LLM, with the arguments vLLM scripts pass ------------------------------------
    llm = c("LLM(model, **typical vLLM kwargs)", lambda: LLM(
        model="smollm2", trust_remote_code=True, dtype="auto", seed=0, gpu_memory_utilization=0.9,
        enforce_eager=True, tensor_parallel_size=1, enable_prefix_caching=True, max_num_seqs=16,
        max_num_batched_tokens=1024, tokenizer="smollm2", tokenizer_mode="auto", generation_config="auto",
        swap_space=0, cpu_offload_gb=0, revision=None, download_dir=None, load_format="auto",
        max_seq_len_to_capture=1024, enable_chunked_prefill=True, disable_custom_all_reduce=True,
        distributed_executor_backend=None, block_size=16, quantization=None, hf_overrides={},
        compilation_config=0, task="generate", max_logprobs=20, **SMALL))
    assert llm is not None, h.results[-1]
    engine = llm.llm_engine
    c("LLM's disable_log_stats defaults to True", lambda: engine.config.disable_log_stats is True,
      lambda v: _true(v))

    # ---- quickstart -------------------------------------------------------------------------
    sampling_params = c("SamplingParams(temperature=0.8, top_p=0.95)",
                        lambda: SamplingParams(temperature=0.8, top_p=0.95))
    outputs = c("llm.generate(prompts, sampling_params)", lambda: llm.generate(PROMPTS, sampling_params),
                lambda v: _true(len(v) == 4))
    out = outputs[0]
    c("output.prompt", lambda: out.prompt, lambda v: _true(v == PROMPTS[0]))
    c("output.outputs[0].text", lambda: out.outputs[0].text, lambda v: _true(isinstance(v, str) and v))
    c("output.outputs[0].token_ids", lambda: out.outputs[0].token_ids, lambda v: _true(0 < len(v) <= 16))
    c("output.prompt_token_ids", lambda: out.prompt_token_ids,
      lambda v: _true(v == llm.get_tokenizer().encode(PROMPTS[0])))
    c("output.request_id", lambda: out.request_id, lambda v: _true(isinstance(v, str)))
    c("output.finished", lambda: out.finished, lambda v: _true(v is True))
    c("output.outputs[0].finish_reason", lambda: out.outputs[0].finish_reason,
      lambda v: _true(v in ("stop", "length")))
    c("output.outputs[0].finished()", lambda: out.outputs[0].finished(), lambda v: _true(v is True))
    c("output.outputs[0].index", lambda: out.outputs[0].index, lambda v: _true(v == 0))
    c("output.prompt_logprobs", lambda: out.prompt_logprobs, lambda v: _true(v is None))
    c("output.num_cached_tokens", lambda: out.num_cached_tokens, lambda v: _true(isinstance(v, int)))
    c("output.metrics.arrival_time", lambda: out.metrics.arrival_time, lambda v: _true(v > 0))
    c("output.metrics.first_token_time", lambda: out.metrics.first_token_time,
      lambda v: _true(v >= out.metrics.arrival_time))
    c("output.metrics.finished_time", lambda: out.metrics.finished_time,
      lambda v: _true(v >= out.metrics.first_token_time))
    c("output.metrics.first_scheduled_time / last_token_time / time_in_queue",
      lambda: (out.metrics.first_scheduled_time, out.metrics.last_token_time, out.metrics.time_in_queue),
      lambda v: _true(v[0] is not None and v[1] is not None and v[2] >= 0))
    c("isinstance(output, RequestOutput) and outputs[0] a CompletionOutput",
      lambda: isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput), _true)
    c("output.lora_request / encoder_prompt / encoder_prompt_token_ids",
      lambda: (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.outputs[0].lora_request),
      lambda v: _true(v == (None, None, None, None)))
    c("repr(RequestOutput)", lambda: repr(out), lambda v: _true("RequestOutput" in v))
    c("pickle RequestOutput", lambda: pickle.loads(pickle.dumps(out)),
      lambda v: _true(v.outputs[0].text == out.outputs[0].text))
    c("copy.deepcopy(RequestOutput)", lambda: copy.deepcopy(out), lambda v: _true(v.prompt == out.prompt))

    # ---- prompt forms ---------------------------------------------------------------------
    greedy = c("SamplingParams(temperature=0.0, max_tokens=12)", lambda: SamplingParams(temperature=0.0, max_tokens=12))
    ref = c("llm.generate(str, params, use_tqdm=False)", lambda: llm.generate(PROMPTS[2], greedy, use_tqdm=False),
            lambda v: _true(len(v) == 1 and "Paris" in v[0].outputs[0].text))
    ref_ids = ref[0].outputs[0].token_ids
    ids = ref[0].prompt_token_ids
    same = lambda v: _true(all(o.outputs[0].token_ids == ref_ids for o in v))  # noqa: E731
    c("llm.generate(TextPrompt(prompt=...))", lambda: llm.generate(TextPrompt(prompt=PROMPTS[2]), greedy,
                                                                    use_tqdm=False), same)
    c("llm.generate({'prompt': ...})", lambda: llm.generate({"prompt": PROMPTS[2]}, greedy, use_tqdm=False), same)
    c("llm.generate(TokensPrompt(prompt_token_ids=...))",
      lambda: llm.generate(TokensPrompt(prompt_token_ids=ids), greedy, use_tqdm=False), same)
    c("llm.generate([{'prompt_token_ids': ...}] * 2)",
      lambda: llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids}], greedy, use_tqdm=False), same)
    c("llm.generate(prompts=..., sampling_params=...) by keyword",
      lambda: llm.generate(prompts=[PROMPTS[2]], sampling_params=greedy, use_tqdm=False), same)
    c("llm.generate(prompts, [params per prompt])",
      lambda: llm.generate(PROMPTS[:2], [greedy, SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False),
      lambda v: _true(len(v[1].outputs[0].token_ids) == 3 and v[1].outputs[0].finish_reason == "length"))
    c("llm.generate(prompts) without sampling params", lambda: llm.generate(PROMPTS[:2], use_tqdm=False),
      lambda v: _true(len(v) == 2))
    c("llm.generate(prompts, priority=[0, 0])", lambda: llm.generate(PROMPTS[:2], greedy, use_tqdm=False,
                                                                      priority=[0, 0]), lambda v: _true(len(v) == 2))
    c("llm.generate(..., lora_request=...)", lambda: llm.generate(PROMPTS[0], greedy, lora_request=object()),
      expect=REFUSED, names=LORA)

    # ---- SamplingParams ----------------------------------------------------------------------
    full = c("SamplingParams(every common field)", lambda: SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=1, max_tokens=10, min_tokens=2,
        presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1, stop=["\n\n"], stop_token_ids=[2],
        include_stop_str_in_output=False, ignore_eos=False, logprobs=3, skip_special_tokens=True,
        spaces_between_special_tokens=True, detokenize=True, truncate_prompt_tokens=512,
        output_kind=RequestOutputKind.CUMULATIVE, extra_args={"tag": 1}))
    c("SamplingParams fields read back", lambda: (full.n, full.temperature, full.top_p, full.top_k, full.max_tokens,
                                                  full.stop, full.logprobs, full.seed),
      lambda v: _true(v == (2, 0.7, 0.9, 50, 10, ["\n\n"], 3, 1)))
    c("repr(SamplingParams)", lambda: repr(full), lambda v: _true("temperature=0.7" in v))
    c("SamplingParams.clone()", lambda: full.clone(), lambda v: _true(v == full and v is not full))
    c("copy.deepcopy(SamplingParams)", lambda: copy.deepcopy(full), lambda v: _true(v == full))
    c("pickle SamplingParams", lambda: pickle.loads(pickle.dumps(full)), lambda v: _true(v == full))
    c("SamplingParams.from_optional(...)", lambda: SamplingParams.from_optional(temperature=None, top_p=None,
                                                                                 max_tokens=8),
      lambda v: _true(v.temperature == 1.0 and v.max_tokens == 8))
    c("SamplingParams() defaults", lambda: SamplingParams(),
      lambda v: _true((v.n, v.temperature, v.top_p, v.top_k, v.max_tokens) == (1, 1.0, 1.0, v.top_k, 16)
                      and v.top_k in (0, -1)))
    c("SamplingParams(temperature=-1) raises ValueError", lambda: _raises(ValueError, SamplingParams, temperature=-1),
      _true)
    c("SamplingParams(temprature=0.5) names the field", lambda: _raises((ValueError, TypeError), SamplingParams,
                                                                          temprature=0.5), _true)
    c("params.max_tokens = 4 (set after construction)", lambda: _set(SamplingParams(temperature=0), "max_tokens", 4),
      keep="four")
    c("generate with a params object changed after construction",
      lambda: llm.generate(PROMPTS[0], ns["four"], use_tqdm=False),
      lambda v: _true(len(v[0].outputs[0].token_ids) == 4))
    c("RequestOutputKind.CUMULATIVE / DELTA / FINAL_ONLY",
      lambda: [k.value for k in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)],
      lambda v: _true(v == [0, 1, 2]))
    c("SamplingParams(prompt_logprobs=1)",
      lambda: llm.generate(PROMPTS[0], SamplingParams(prompt_logprobs=1, max_tokens=1), use_tqdm=False),
      lambda v: _true(v[0].prompt_logprobs[0] is None and len(v[0].prompt_logprobs) == len(v[0].prompt_token_ids)))
    c("generate with SamplingParams(logit_bias={...})",
      lambda: llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logit_bias={10: 100.0}),
                           use_tqdm=False),
      lambda v: _true(v[0].outputs[0].token_ids == [10] * 4))
    c("generate with SamplingParams(allowed_token_ids=[...])",
      lambda: llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, max_tokens=8, allowed_token_ids=[11, 12, 13]),
                           use_tqdm=False),
      lambda v: _true(set(v[0].outputs[0].token_ids) <= {11, 12, 13}))
    c("generate with SamplingParams(bad_words=[...])",
      lambda: llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, bad_words=["the", "The"]),
                           use_tqdm=False),
      lambda v: _true(len(v[0].outputs[0].token_ids) > 0))
    c("SamplingParams(use_beam_search=True)", lambda: SamplingParams(use_beam_search=True), expect=REFUSED,
      names=BEAM)

    # ---- outputs in detail -------------------------------------------------------------------
    sampled = c("llm.generate(n=2, logprobs=3, seed)", lambda: llm.generate(
        PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=6, logprobs=3), use_tqdm=False))
    so = sampled[0]
    c("n=2 gives two CompletionOutputs", lambda: [o.index for o in so.outputs], lambda v: _true(v == [0, 1]))
    c("completion.logprobs: one dict per token", lambda: so.outputs[0].logprobs,
      lambda v: _true(len(v) == len(so.outputs[0].token_ids) and all(t in d for t, d in
                                                                     zip(so.outputs[0].token_ids, v))))
    lp = so.outputs[0].logprobs[0][so.outputs[0].token_ids[0]]
    c("Logprob.logprob", lambda: lp.logprob, lambda v: _true(v <= 0))
    c("Logprob.rank", lambda: lp.rank, lambda v: _true(isinstance(v, int) and v >= 1))
    c("Logprob.decoded_token", lambda: lp.decoded_token, lambda v: _true(isinstance(v, str)))
    c("isinstance(entry, vllm.logprobs.Logprob)", lambda: isinstance(lp, ns.get("Logprob", ())), _true)
    c("completion.cumulative_logprob", lambda: so.outputs[0].cumulative_logprob,
      lambda v: _true(abs(v - sum(d[t].logprob for t, d in zip(so.outputs[0].token_ids,
                                                                so.outputs[0].logprobs))) < 1e-3))
    c("same seed, same samples", lambda: llm.generate(
        PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=6, logprobs=3), use_tqdm=False),
      lambda v: _true([o.token_ids for o in v[0].outputs] == [o.token_ids for o in so.outputs]))
    stop = c("stop=['.'] -> finish_reason 'stop', stop_reason '.'", lambda: llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=["."]), use_tqdm=False))
    c("stop_reason of a stop string", lambda: (stop[0].outputs[0].finish_reason, stop[0].outputs[0].stop_reason),
      lambda v: _true(v == ("stop", ".")))
    c("include_stop_str_in_output=True", lambda: llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=["."], include_stop_str_in_output=True),
        use_tqdm=False), lambda v: _true(v[0].outputs[0].text.endswith(".")))
    stop_id = ref_ids[2]
    c("stop_token_ids -> stop_reason is the id", lambda: llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False),
      lambda v: _true(v[0].outputs[0].stop_reason == stop_id and v[0].outputs[0].finish_reason == "stop"))
    c("max_tokens=3 -> finish_reason 'length'", lambda: llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False),
      lambda v: _true(v[0].outputs[0].finish_reason == "length" and v[0].outputs[0].stop_reason is None))
    c("ignore_eos=True, min_tokens", lambda: llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True), use_tqdm=False),
      lambda v: _true(len(v[0].outputs[0].token_ids) == 8))
    c("top_k / top_p / min_p / penalties generate", lambda: llm.generate(
        PROMPTS[3], SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                                   presence_penalty=0.5, frequency_penalty=0.5, seed=3, max_tokens=8),
        use_tqdm=False), lambda v: _true(len(v[0].outputs[0].token_ids) > 0))
    c("truncate_prompt_tokens=3", lambda: llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3), use_tqdm=False),
      lambda v: _true(len(v[0].prompt_token_ids) == 3))
    c("detokenize=False", lambda: llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, detokenize=False), use_tqdm=False),
      lambda v: _true(v[0].outputs[0].text == "" and len(v[0].outputs[0].token_ids) == 4))
    c("logprobs=0 (the sampled token only)", lambda: llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False),
      lambda v: _true(all(len(d) == 1 for d in v[0].outputs[0].logprobs)))
    c("a full logprobs output: top-k entries sorted by rank", lambda: llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, logprobs=5), use_tqdm=False),
      lambda v: _true(sorted(e.rank for e in v[0].outputs[0].logprobs[0].values())[:5] == [1, 2, 3, 4, 5]))
    c("output_kind=DELTA still gives final outputs from LLM.generate", lambda: llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA),
        use_tqdm=False), same)

    # ---- default sampling params (basic/generate.py) ---------------------------------------
    defaults = c("llm.get_default_sampling_params()", lambda: llm.get_default_sampling_params(),
                 lambda v: _true(isinstance(v, SamplingParams)))
    c("defaults.max_tokens = 5; generate", lambda: llm.generate(PROMPTS, _set(defaults, "max_tokens", 5),
                                                                 use_tqdm=False),
      lambda v: _true(all(len(o.outputs[0].token_ids) <= 5 for o in v)))

    # ---- chat (basic/chat.py) ---------------------------------------------------------------
    chat_params = SamplingParams(temperature=0, max_tokens=8)
    chat = c("llm.chat(conversation, sampling_params, use_tqdm=False)",
             lambda: llm.chat(CONVERSATION, chat_params, use_tqdm=False),
             lambda v: _true(len(v) == 1 and v[0].outputs[0].text))
    chat_ids = chat[0].outputs[0].token_ids
    same_chat = lambda v: _true(all(o.outputs[0].token_ids == chat_ids for o in v))  # noqa: E731
    c("llm.chat(messages=..., sampling_params=...)", lambda: llm.chat(messages=CONVERSATION,
                                                                       sampling_params=chat_params, use_tqdm=False),
      same_chat)
    c("llm.chat([conversation] * 3) (batch)", lambda: llm.chat([CONVERSATION] * 3, chat_params, use_tqdm=False),
      lambda v: _true(len(v) == 3) or same_chat(v))
    c("llm.chat with OpenAI content parts", lambda: llm.chat(
        [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION], chat_params,
        use_tqdm=False), same_chat)
    c("llm.chat without a system prompt", lambda: llm.chat([{"role": "user", "content": "Hi!"}], chat_params,
                                                           use_tqdm=False), lambda v: _true(len(v) == 1))
    c("llm.chat(chat_template=...)", lambda: llm.chat(
        CONVERSATION, chat_params, use_tqdm=False,
        chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"),
      lambda v: _true(v[0].prompt.startswith("system: You are")))
    c("llm.chat(add_generation_prompt=False, continue_final_message=True)", lambda: llm.chat(
        [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}],
        chat_params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True),
      lambda v: _true(v[0].prompt.rstrip().endswith("The color is")))
    c("llm.chat(chat_template_kwargs={...})", lambda: llm.chat(
        CONVERSATION, chat_params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False}), same_chat)
    c("llm.chat(chat_template_content_format='openai')", lambda: llm.chat(
        CONVERSATION, chat_params, use_tqdm=False, chat_template_content_format="openai"), same_chat)
    c("llm.chat(tools=[...])", lambda: llm.chat(
        [{"role": "user", "content": "Weather in Paris?"}], chat_params, use_tqdm=False,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                                 "parameters": {"type": "object", "properties": {}}}}]),
      lambda v: _true(len(v) == 1))
    c("llm.chat(..., lora_request=...)", lambda: llm.chat(CONVERSATION, chat_params, lora_request=object()),
      expect=REFUSED, names=LORA)

    # ---- the tokenizer ----------------------------------------------------------------------
    tokenizer = c("llm.get_tokenizer()", lambda: llm.get_tokenizer())
    c("tokenizer.encode(text)", lambda: tokenizer.encode(PROMPTS[2]), lambda v: _true(v == ids))
    c("tokenizer.decode(ids)", lambda: tokenizer.decode(ref_ids, skip_special_tokens=True),
      lambda v: _true(v == ref[0].outputs[0].text))
    c("tokenizer(text).input_ids", lambda: tokenizer(PROMPTS[2]).input_ids, lambda v: _true(v == ids))
    c("tokenizer.eos_token_id / eos_token", lambda: (tokenizer.eos_token_id, tokenizer.eos_token),
      lambda v: _true(isinstance(v[0], int)))
    c("len(tokenizer), convert_ids_to_tokens", lambda: (len(tokenizer), tokenizer.convert_ids_to_tokens(ids)),
      lambda v: _true(v[0] > 1000 and len(v[1]) == len(ids)))
    text = c("tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)",
             lambda: tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True),
             lambda v: _true(isinstance(v, str)))
    c("llm.generate(the rendered chat text) matches llm.chat", lambda: llm.generate(
        TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False)), chat_params,
        use_tqdm=False), same_chat)
    c("TokensPrompt(prompt_token_ids=tokenizer.apply_chat_template(..., tokenize=True))", lambda: llm.generate(
        TokensPrompt(prompt_token_ids=tokenizer.apply_chat_template(CONVERSATION, tokenize=True,
                                                                    add_generation_prompt=True)),
        chat_params, use_tqdm=False), same_chat)
    c("llm.set_tokenizer(tokenizer)", lambda: llm.set_tokenizer(tokenizer))
    c("llm.llm_engine.get_tokenizer()", lambda: engine.get_tokenizer(), lambda v: _true(v is tokenizer))
    c("llm.llm_engine.tokenizer", lambda: engine.tokenizer, lambda v: _true(v is not None))

    # ---- configuration ----------------------------------------------------------------------
    c("llm.llm_engine.model_config.max_model_len", lambda: engine.model_config.max_model_len,
      lambda v: _true(v == 1024))
    c("llm.model_config.max_model_len", lambda: llm.model_config.max_model_len, lambda v: _true(v == 1024))
    c("llm.llm_engine.get_model_config()", lambda: engine.get_model_config(),
      lambda v: _true(v.max_model_len == 1024))
    c("model_config.hf_config.vocab_size", lambda: engine.model_config.hf_config.vocab_size,
      lambda v: _true(v == 49152))
    c("model_config.get_vocab_size()", lambda: engine.model_config.get_vocab_size(), lambda v: _true(v == 49152))
    c("model_config.model / served_model_name / dtype / seed",
      lambda: (engine.model_config.model, engine.model_config.served_model_name, engine.model_config.dtype,
               engine.model_config.seed), lambda v: _true(v[0].endswith(".gguf") and v[3] == 0))
    c("model_config.get_sliding_window()", lambda: engine.model_config.get_sliding_window(),
      lambda v: _true(v is None))
    c("llm.llm_engine.vllm_config.cache_config.block_size", lambda: engine.vllm_config.cache_config.block_size,
      lambda v: _true(v == 16))
    c("vllm_config.scheduler_config.max_num_seqs", lambda: engine.vllm_config.scheduler_config.max_num_seqs,
      lambda v: _true(v == 16))
    c("vllm_config.parallel_config.tensor_parallel_size",
      lambda: engine.vllm_config.parallel_config.tensor_parallel_size, lambda v: _true(v == 1))
    c("llm.llm_engine.cache_config.num_gpu_blocks", lambda: engine.cache_config.num_gpu_blocks,
      lambda v: _true(v > 0))

    # ---- prefix caching (automatic_prefix_caching.py) ----------------------------------------
    long_prefix = "You are an expert school principal. " * 20
    c("llm.reset_prefix_cache()", lambda: llm.reset_prefix_cache(), lambda v: _true(v is True))
    c("first prompt with a long shared prefix", lambda: llm.generate(long_prefix + "Who is the tallest?",
                                                                     greedy, use_tqdm=False))
    c("second prompt hits the prefix cache (num_cached_tokens)", lambda: llm.generate(
        long_prefix + "Who is the youngest?", greedy, use_tqdm=False),
      lambda v: _true(v[0].num_cached_tokens >= 16))

    # ---- metrics (metrics.py) -----------------------------------------------------------------
    metrics = c("llm.get_metrics()", lambda: llm.get_metrics(), lambda v: _true(len(v) > 0))
    Counter, Gauge, Histogram, Vector = (ns.get(n, ()) for n in ("Counter", "Gauge", "Histogram", "Vector"))
    by_name = {m.name: m for m in metrics}
    c("a Gauge: vllm:num_requests_running", lambda: by_name["vllm:num_requests_running"],
      lambda v: _true(isinstance(v, Gauge) and v.value == 0))
    c("a Counter: vllm:prompt_tokens (value)", lambda: by_name["vllm:prompt_tokens"],
      lambda v: _true(isinstance(v, Counter) and v.value > 0))
    c("a Counter: vllm:generation_tokens", lambda: by_name["vllm:generation_tokens"],
      lambda v: _true(isinstance(v, Counter) and v.value > 0))
    c("a Histogram: vllm:time_to_first_token_seconds (count, sum, buckets)",
      lambda: by_name["vllm:time_to_first_token_seconds"],
      lambda v: _true(isinstance(v, Histogram) and v.count > 0 and v.sum > 0 and "+Inf" in v.buckets))
    c("vllm:request_success counter", lambda: [m for m in metrics if m.name == "vllm:request_success"],
      lambda v: _true(v and all(isinstance(m, Counter) for m in v)))
    c("vllm:kv_cache_usage_perc gauge", lambda: by_name["vllm:kv_cache_usage_perc"],
      lambda v: _true(isinstance(v, Gauge)))
    c("vllm:prefix_cache_hits counter", lambda: by_name["vllm:prefix_cache_hits"],
      lambda v: _true(isinstance(v, Counter) and v.value > 0))
    c("every metric is a Gauge, Counter, Vector or Histogram",
      lambda: all(isinstance(m, (Gauge, Counter, Vector, Histogram)) for m in metrics), _true)
    c("metric.labels", lambda: by_name["vllm:num_requests_running"].labels,
      lambda v: _true(isinstance(v, dict) and "model_name" in v))

    # ---- profiling (simple_profiling.py: VLLM_TORCH_PROFILER_DIR set before LLM) --------------
    c("llm.start_profile()", lambda: llm.start_profile())
    c("generate while profiling", lambda: llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2),
                                                       use_tqdm=False))
    c("llm.stop_profile() writes a trace", lambda: llm.stop_profile(),
      lambda v: _true(os.path.isdir(tmp_path / "profile") and os.listdir(tmp_path / "profile")))

    # ---- model access ------------------------------------------------------------------------
    c("llm.apply_model(fn)", lambda: llm.apply_model(lambda model: type(model).__name__),
      lambda v: _true(isinstance(v, list) and len(v) == 1 and isinstance(v[0], str)))
    c("llm.collective_rpc(fn)", lambda: llm.collective_rpc(lambda worker: 7), lambda v: _true(v == [7]))
    c("llm.sleep(level=1)", lambda: llm.sleep(level=1), expect=UNSUPPORTED, names="sleep mode")
    c("llm.wake_up()", lambda: llm.wake_up(), expect=UNSUPPORTED, names="sleep mode")

    # ---- pooling and beam search ---------------------------------------------------------------
    c("llm.embed(prompts)", lambda: llm.embed(PROMPTS), expect=REFUSED, names=POOLING)
    c("llm.encode(prompts)", lambda: llm.encode(PROMPTS), expect=REFUSED, names=POOLING)
    c("llm.classify(prompts)", lambda: llm.classify(PROMPTS), expect=REFUSED, names=POOLING)
    c("llm.score(text_1, text_2)", lambda: llm.score("What is the capital of France?", "Paris"), expect=REFUSED,
      names=POOLING)
    c("llm.reward(prompts)", lambda: llm.reward(PROMPTS), expect=REFUSED, names=POOLING)
    c("llm.beam_search(prompts, params)", lambda: llm.beam_search([{"prompt": PROMPTS[0]}], None), expect=REFUSED,
      names=BEAM)

    # ---- EngineArgs and the argument parser (basic/generate.py, llm_engine_example.py) --------
    engine_args = c("EngineArgs(model=..., max_model_len=..., ...)", lambda: EngineArgs(
        model="smollm2", max_model_len=1024, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
        max_num_seqs=8))
    c("engine_args fields", lambda: (engine_args.model, engine_args.max_model_len, engine_args.seed,
                                     engine_args.enable_prefix_caching),
      lambda v: _true(v[:3] == ("smollm2", 1024, 0)))
    c("dataclasses.asdict(engine_args)", lambda: dataclasses.asdict(engine_args),
      lambda v: _true(v["max_model_len"] == 1024))
    c("dataclasses.replace(engine_args, seed=1)", lambda: dataclasses.replace(engine_args, seed=1),
      lambda v: _true(v.seed == 1))
    c("EngineArgs(dtype='half', max_logprobs=-1).create_engine_config()", lambda: EngineArgs(
        model="smollm2", dtype="half", max_logprobs=-1, **SMALL).create_engine_config(),
      lambda v: _true(v.max_logprobs == -1 and str(v.dtype) == "torch.float16"))
    c("AsyncEngineArgs(model=...)", lambda: ns["AsyncEngineArgs"](model="smollm2", max_model_len=1024),
      lambda v: _true(v.max_model_len == 1024))
    parser = c("parser = EngineArgs.add_cli_args(FlexibleArgumentParser())",
               lambda: EngineArgs.add_cli_args(ns["FlexibleArgumentParser"]()),
               lambda v: _true(hasattr(v, "parse_args")))
    c("EngineArgs.add_cli_args(parser.add_argument_group(...))",
      lambda: EngineArgs.add_cli_args(ns["FlexibleArgumentParser"]().add_argument_group("Engine arguments")))
    args = c("parser.parse_args([...])", lambda: parser.parse_args(
        ["--model", "smollm2", "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "8",
         "--kv-cache-memory-bytes", str(64 << 20)]), lambda v: _true(v.max_model_len == 1024))
    from_cli = c("EngineArgs.from_cli_args(args)", lambda: EngineArgs.from_cli_args(args),
                 lambda v: _true(v.max_model_len == 1024 and v.enforce_eager is True))

    # ---- the LLMEngine step loop (llm_engine_example.py) --------------------------------------
    eng = c("LLMEngine.from_engine_args(engine_args)", lambda: LLMEngine.from_engine_args(from_cli or engine_args))
    assert eng is not None, h.results[-1]
    test_prompts = [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1,
                                                        max_tokens=8)),
    ]
    for i, (prompt, params) in enumerate(test_prompts):
        c(f"engine.add_request(str({i}), prompt, params)", lambda: eng.add_request(str(i), prompt, params))
    uid = ns["random_uuid"]()
    c("engine.add_request(random_uuid(), TokensPrompt, params)", lambda: eng.add_request(
        uid, TokensPrompt(prompt_token_ids=ids), SamplingParams(temperature=0, max_tokens=12)))
    c("engine.add_request(id, prompt, params, arrival_time=..., priority=0)", lambda: eng.add_request(
        "delta", {"prompt": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4,
                                                        output_kind=RequestOutputKind.DELTA), priority=0))
    c("engine.add_request('tmp', ...) then engine.abort_request(['tmp'])", lambda: (
        eng.add_request("tmp", PROMPTS[1], SamplingParams(max_tokens=4)), eng.abort_request(["tmp"])))
    c("engine.get_num_unfinished_requests()", lambda: eng.get_num_unfinished_requests(), lambda v: _true(v == 5))
    c("engine.add_request(..., lora_request=...)", lambda: eng.add_request("x", PROMPTS[0], greedy,
                                                                           lora_request=object()),
      expect=REFUSED, names=LORA)
    finished, deltas = {}, []

    def loop():
        for _ in range(500):
            if not eng.has_unfinished_requests():
                return
            request_outputs = eng.step()
            for request_output in request_outputs:
                if request_output.request_id == "delta":
                    deltas.append(request_output.outputs[0].text)
                if request_output.finished:
                    finished[request_output.request_id] = request_output
        raise AssertionError("the loop did not finish")

    c("while engine.has_unfinished_requests(): engine.step()", loop,
      lambda v: _true(set(finished) == {"0", "1", "2", uid, "delta"}))
    c("print(request_output) (repr)", lambda: repr(finished["0"]), lambda v: _true("request_id='0'" in v))
    c("step outputs are RequestOutputs", lambda: all(isinstance(o, RequestOutput) for o in finished.values()), _true)
    c("the loop matches llm.generate (greedy)", lambda: finished[uid].outputs[0].token_ids,
      lambda v: _true(v == ref_ids))
    c("n=2 in the loop", lambda: len(finished["2"].outputs), lambda v: _true(v == 2))
    c("logprobs=1 in the loop", lambda: finished["0"].outputs[0].logprobs,
      lambda v: _true(len(v) == len(finished["0"].outputs[0].token_ids)))
    c("DELTA outputs in the loop add up", lambda: "".join(deltas),
      lambda v: _true(v == llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4),
                                        use_tqdm=False)[0].outputs[0].text))
    c("engine.has_unfinished_requests() at the end", lambda: eng.has_unfinished_requests(),
      lambda v: _true(v is False))
    c("engine.get_model_config().max_model_len", lambda: eng.get_model_config().max_model_len,
      lambda v: _true(v == 1024))
    c("engine.get_tokenizer().decode", lambda: eng.get_tokenizer().decode(ids), lambda v: _true(PROMPTS[2] in v))
    c("engine.reset_prefix_cache()", lambda: eng.reset_prefix_cache(), lambda v: _true(v is True))
    c("engine.do_log_stats()", lambda: eng.do_log_stats())
    c("engine.get_default_sampling_params()? (vLLM: via the LLM)", lambda: eng.get_default_sampling_params(),
      lambda v: _true(isinstance(v, SamplingParams)))

    # ---- LLM from EngineArgs (vision examples: LLM(**asdict(engine_args))) ----------------------
    c("LLM(**dataclasses.asdict(engine_args)) argument check", lambda: _asdict_kwargs_accepted(engine_args))
    eng.close()

    # ---- AsyncLLM (async_llm_streaming.py) ----------------------------------------------------
    asyncio.run(async_section(h, ref[0].outputs[0].text))


async def async_section(h: Harness, greedy_text: str) -> None:
    ns, c, ac = h.ns, h.call, h.acall
    SamplingParams, RequestOutputKind = ns["SamplingParams"], ns["RequestOutputKind"]
    engine = c("AsyncLLM.from_engine_args(AsyncEngineArgs(model, enforce_eager=True, disable_log_requests=True))",
               lambda: ns["AsyncLLM"].from_engine_args(ns["AsyncEngineArgs"](
                   model="smollm2", enforce_eager=True, disable_log_requests=True, **SMALL)))
    if engine is None:
        return  # recorded as failed; the calls on it cannot run
    try:
        delta = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)

        async def stream(params, request_id):
            pieces, last = [], None
            async for output in engine.generate(request_id=request_id, prompt=PROMPTS[2], sampling_params=params):
                pieces += [completion.text for completion in output.outputs]
                last = output
                if output.finished:
                    break
            return pieces, last

        await ac("async for output in engine.generate(..., DELTA)", lambda: stream(delta, "stream-1"),
                 lambda v: _true("".join(v[0]) == greedy_text and v[1].finished))
        await ac("engine.generate(...) cumulative by default", lambda: stream(
            SamplingParams(temperature=0, max_tokens=12), "stream-2"),
            lambda v: _true(v[0][-1] == greedy_text and all(greedy_text.startswith(p) for p in v[0])))
        await ac("engine.generate(prompt, params, request_id) positionally", lambda: _first(
            engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12,
                                                       output_kind=RequestOutputKind.FINAL_ONLY), "final-1")),
            lambda v: _true(v.outputs[0].text == greedy_text))
        await ac("await engine.get_tokenizer()", lambda: engine.get_tokenizer(), lambda v: _true(v.encode("a")))
        await ac("await engine.get_model_config()", lambda: engine.get_model_config(),
                 lambda v: _true(v.max_model_len == 1024))
        c("engine.model_config.max_model_len", lambda: engine.model_config.max_model_len,
          lambda v: _true(v == 1024))
        await ac("await engine.reset_prefix_cache()", lambda: engine.reset_prefix_cache())
        await ac("await engine.check_health()", lambda: engine.check_health())
        c("engine.is_running / engine.errored", lambda: (engine.is_running, engine.errored),
          lambda v: _true(v == (True, False)))
        await ac("await engine.abort(request_id)", lambda: _abort_midway(engine, SamplingParams))
    finally:
        c("engine.shutdown()", lambda: engine.shutdown())
    c("engine.errored after shutdown", lambda: engine.errored, _true)


async def _first(stream):
    async for output in stream:
        return output


async def _abort_midway(engine, SamplingParams) -> bool:
    """Start a long request, abort it after its first output: its stream ends (vLLM's
    stream raises nothing either, or the engine's abort error, when aborted)."""
    outputs = []
    stream = engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), "to-abort")
    try:
        async for output in stream:
            outputs.append(output)
            if len(outputs) == 1:
                await engine.abort("to-abort")
    except Exception as e:  # noqa: BLE001 - an abort error is an ending too
        assert "abort" in str(e).lower(), e
    assert outputs and len(outputs[-1].outputs[0].token_ids) < 200
    return True


def _true(value) -> None:
    assert value, f"unexpected result: {value!r:.200}"


def _raises(kinds, fn, **kwargs) -> bool:
    try:
        fn(**kwargs)
    except kinds:
        return True
    return False


def _set(obj, name, value):
    setattr(obj, name, value)
    return obj


def _asdict_kwargs_accepted(engine_args) -> bool:
    """LLM(**asdict(engine_args)) passes every field back: EngineArgs.from_kwargs (what
    LLM(...) calls first) must take them all (the model then loads as any LLM's)."""
    from nanokv.engine.arg_utils import EngineArgs

    rebuilt = EngineArgs.from_kwargs(**dataclasses.asdict(engine_args))
    assert rebuilt == engine_args
    return True
