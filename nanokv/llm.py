"""LLM: the offline entry point, vLLM's API."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence as Seq

import torch
from tqdm.auto import tqdm

from nanokv.config import EngineConfig
from nanokv.engine.stats import KVStats
from nanokv.llm_engine import LLMEngine, PromptType
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import SamplingParams

logger = logging.getLogger("nanokv")


class LLM:
    """Load a Hugging Face model directory and generate from it.

    >>> llm = LLM("path/to/Qwen3-0.6B")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        kvcache_block_size: int = 16,
        num_kvcache_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        seed: int = 0,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
    ):
        config = EngineConfig.create(
            model, dtype=dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kvcache_block_size=kvcache_block_size, num_kvcache_blocks=num_kvcache_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, seed=seed,
            attention_backend=attention_backend, tensor_parallel_size=tensor_parallel_size)
        self.llm_engine = LLMEngine(config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def close(self) -> None:
        """Stop tensor-parallel worker processes now (they also stop when the LLM is
        garbage collected or the program exits)."""
        self.llm_engine.runner.close()

    def kv_stats(self) -> KVStats:
        """KV pool use, fragmentation, prefix-cache hits and preemptions so far."""
        return self.llm_engine.kv_stats()

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request piece by piece as tokens arrive."""
        engine = self.llm_engine
        request_id = engine.add_request(prompt, sampling_params, stream=True)
        done = False
        try:
            while not done:
                for out in engine.step():
                    if out.request_id == request_id:
                        done = out.finished
                        for completion in out.outputs:
                            if completion.text:
                                yield completion.text
        finally:
            if not done:  # the caller stopped early
                engine.abort(request_id)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        prompts: a str, a list of str, a list of token ids, or a list of lists of token
        ids (dicts with "prompt" or "prompt_token_ids" also work). Every request is
        validated before any work starts: one bad prompt raises ValueError and nothing runs.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                                 "pass one SamplingParams or one per prompt")
        engine = self.llm_engine
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                requests.append(engine.make_request(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        order = {req.request_id: i for i, req in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        for req in requests:
            engine.enqueue(req)
        try:
            self._run(results, order, use_tqdm)
        finally:  # interrupted: leave the engine clean for the next call
            for req in requests:
                if results[order[req.request_id]] is None:
                    engine.abort(req.request_id)
        logger.info(engine.kv_stats().summary())
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or
        to a list of them, rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [render_chat(tokenizer, conv, chat_template, add_generation_prompt) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, results, order, use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        prefill_rate = decode_rate = 0.0
        last_postfix = 0.0
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    i = order.get(out.request_id)
                    if i is not None and out.finished:  # others were added through the engine
                        results[i] = out
                        bar.update(1)
                s = engine.last_step
                if s.seconds > 0:
                    if s.prefill_tokens:
                        prefill_rate = s.prefill_tokens / s.seconds
                    if s.decode_tokens:
                        decode_rate = s.decode_tokens / s.seconds
                now = time.perf_counter()
                if use_tqdm and now - last_postfix > 0.2:
                    last_postfix = now
                    kv = engine.kv_stats()
                    bar.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s, "
                                        f"KV {kv.usage:.0%}, hit {kv.hit_rate:.0%}", refresh=False)
        finally:
            bar.close()


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True) -> dict:
    """One conversation -> {"prompt": text, "prompt_token_ids": ids} via the chat template."""
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # no template, malformed messages
        raise ValueError(f"cannot apply the chat template: {e}") from e
    # the template already holds the special tokens: add none
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
