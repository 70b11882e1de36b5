"""LLM: the offline entry point, vLLM's API."""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Iterator, Sequence as Seq

from tqdm.auto import tqdm

from nanokv.engine.arg_utils import EngineArgs
from nanokv.engine.stats import KVStats
from nanokv.llm_engine import LLMEngine, PromptType, check_text, check_vllm_extras
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import SamplingParams
from nanokv.tool_calls import with_tools
from nanokv.unsupported import BEAM_SEARCH, MULTIMODAL, POOLING, SLEEP_MODE

logger = logging.getLogger("nanokv")


class LLM:
    """Load a Hugging Face model directory and generate from it.

    >>> llm = LLM("path/to/Qwen3-0.6B")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text

    Thread-safe: generate(), chat(), stream(), kv_stats() and close() may be called from
    several threads at once. Every engine call is made under the engine's lock, held for
    one step at a time (never across a stream's yield); calls running together share the
    engine's steps (their requests are batched together) and each gets exactly its own
    outputs, through its own sink.
    """

    def __init__(self, model: str, **kwargs):
        """model: a Hugging Face model directory, a .gguf file (or a directory holding
        one), or a built-in name ("smollm2"). kwargs: engine arguments (EngineArgs: dtype,
        device, max_model_len, max_num_seqs, ...; vLLM's names such as block_size work too);
        an unknown name raises ValueError suggesting the closest one. disable_log_stats
        defaults to True here, as in vLLM's LLM (EngineArgs' default is False)."""
        kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default: no statistics lines
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(args.create_engine_config())
        self.model_config = self.llm_engine.model_config  # vLLM's ModelConfig view (nanokv.vllm_config)
        self._lock = self.llm_engine.lock

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def set_tokenizer(self, tokenizer) -> None:
        """Use another tokenizer (same ids as the model's) for prompts and output text."""
        self.llm_engine.set_tokenizer(tokenizer)

    def reset_prefix_cache(self, device=None) -> bool:
        """Forget every cached prefix (vLLM's; device has no effect). Returns False, and
        forgets nothing, while requests hold KV blocks (another thread's generate())."""
        return self.llm_engine.reset_prefix_cache()

    # vLLM's pooling and beam-search methods: not supported here, and they say so
    def embed(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.embed: {POOLING}")

    def encode(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.encode: {POOLING}")

    def classify(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.classify: {POOLING}")

    def score(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.score: {POOLING}")

    def reward(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.reward: {POOLING}")

    def beam_search(self, *args, **kwargs):
        raise NotImplementedError(f"LLM.beam_search: {BEAM_SEARCH}")

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError(f"LLM.sleep: {SLEEP_MODE}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError(f"LLM.wake_up: {SLEEP_MODE}")

    def start_profile(self) -> None:
        """Start torch.profiler over this process's steps (vLLM's; the trace goes to the
        directory in VLLM_TORCH_PROFILER_DIR or NANOKV_TORCH_PROFILER_DIR when stop_profile()
        is called). With tensor_parallel_size > 1 only rank 0 (this process) is traced."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop the profiler and write its trace (a TensorBoard / Perfetto .pt.trace.json.gz)."""
        self.llm_engine.stop_profile()

    def apply_model(self, func: Callable) -> list:
        """vLLM's: func(model) on the model (the torch.nn.Module), one result per rank; with
        tensor_parallel_size > 1 refused (the other ranks live in worker processes)."""
        return self.collective_rpc(lambda runner: func(runner.model))

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: call method on every worker and return their results, one per rank. The
        worker here is nanokv's ModelRunner (its .model, .config; its methods are not vLLM
        Worker's): a callable gets it as first argument, a string names one of its methods.
        Runs between two steps. With tensor_parallel_size > 1 refused (the other ranks live
        in worker processes). timeout has no effect."""
        return self.llm_engine.collective_rpc(method, args, kwargs or {})

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams generate(), chat() and stream() use when given none: the
        model's generation_config.json defaults (EngineArgs.generation_config; 'vllm': none)
        over SamplingParams()."""
        return self.llm_engine.get_default_sampling_params()

    def close(self) -> None:
        """Stop tensor-parallel worker processes and free the KV pool now (both also
        happen when the LLM is garbage collected or the program exits; the engine holds
        reference cycles, so that can be later than `del llm`). Later calls raise
        RuntimeError. Called while another thread generates, it waits for the step in
        progress; that thread's call then raises RuntimeError."""
        self.llm_engine.close()  # under the engine's lock

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): every vllm: metric of this engine (the names the server's
        /metrics serves) as vllm.v1.metrics.reader records: nanokv.metrics.reader's Counter,
        Gauge and Histogram, each with name, labels and value (or count, sum, buckets)."""
        return self.llm_engine.get_metrics()  # under the engine's lock

    def kv_stats(self) -> KVStats:
        """KV pool use, fragmentation, prefix-cache hits and preemptions so far."""
        return self.llm_engine.kv_stats()  # under the engine's lock

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request piece by piece as tokens arrive (n must be 1:
        for several samples use generate(), or the step API with stream=True, whose
        deltas carry each sample's index)."""
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            raise ValueError(f"stream() yields one sample's text, but n={sampling_params.n}; use n=1, "
                             "or llm_engine.add_request(..., stream=True), whose deltas name each sample")
        engine, lock = self.llm_engine, self._lock
        sink: list[RequestOutput] = []
        with lock:
            req = engine.make_request(prompt, sampling_params, stream=True)
            engine.enqueue(req, sink)
        done = False
        try:
            while not done:
                with lock:  # another thread's step may fill the sink: look under the lock
                    if not sink:
                        engine.advance()
                        if not sink and not engine.has_request(req.request_id):
                            _aborted_elsewhere([req.request_id])
                        continue
                    out = sink.pop(0)
                done = out.finished
                if out.error is not None:
                    raise RuntimeError(f"request failed: {out.error}")
                for completion in out.outputs:
                    if completion.text:
                        yield completion.text
        finally:
            if not done:  # the caller stopped early, or an interrupt
                with lock:
                    engine.abort(req.request_id)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        lora_request=None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        prompts: a str, a list of str, a list of token ids, or a list of lists of token
        ids (TextPrompt / TokensPrompt dicts with "prompt" or "prompt_token_ids" also
        work). sampling_params None: get_default_sampling_params() (the model's generation
        config). Every request is validated before any work starts: one bad prompt raises
        ValueError and nothing runs. A request that fails inside a step comes back with
        finish_reason "error" and its reason in RequestOutput.error; the others run to the
        end. Outputs are final whatever SamplingParams.output_kind says (as in vLLM).

        use_tqdm: show a progress bar (or a tqdm-like class to make it with, as vLLM
        takes). lora_request, tokenization_kwargs and a non-zero priority are refused
        (not supported by nanokv).
        """
        check_vllm_extras(lora_request, tokenization_kwargs, priority or ())
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        engine, lock = self.llm_engine, self._lock
        requests, queued = [], []
        sink: list[RequestOutput] = []
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = []
        try:
            # made and queued in one hold of the lock: the tokenizer is not safe to call from
            # two threads at once, and an id made here must not be taken by another thread's
            # add_request(request_id=...) before it is queued
            with lock:
                for i, (prompt, p) in enumerate(zip(prompts, params)):
                    try:
                        requests.append(engine.make_request(prompt, p))
                    except ValueError as e:
                        raise ValueError(f"prompt {i}: {e}") from None
                for req in requests:
                    engine.enqueue(req, sink)
                    queued.append(req)
            order = {req.request_id: i for i, req in enumerate(requests)}
            results = [None] * len(requests)
            self._run(results, order, sink, use_tqdm)
        finally:  # interrupted: leave the engine clean for the next call (only its own requests)
            with lock:
                _abort_all(engine, [req.request_id for req in queued
                                    if not results or results[order[req.request_id]] is None])
        failed = [out for out in results if out.error is not None]
        if failed:
            logger.warning("%d of %d requests failed in the engine (finish_reason 'error'); first: %s",
                           len(failed), len(results), failed[0].error)
        if not self.llm_engine.config.disable_log_stats:
            logger.info(self.kv_stats().summary())
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or
        to a list of them, rendered with the tokenizer's chat template (vLLM's arguments).

        content: a string, or OpenAI's content parts [{"type": "text", "text": ...}],
        joined with newlines as the server does (chat_template_content_format="openai"
        hands the parts to the template as they are). continue_final_message: end the
        prompt inside the last message (an assistant prefix to continue) instead of
        opening a new one; it needs add_generation_prompt=False. tools go to the template;
        chat_template_kwargs are passed to tokenizer.apply_chat_template (e.g.
        {"enable_thinking": False}). lora_request and mm_processor_kwargs are refused."""
        check_vllm_extras(lora_request)
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs: {MULTIMODAL}")
        conversations = _as_conversations(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        with self._lock:  # the tokenizer is not safe to call from two threads at once
            for i, conv in enumerate(conversations):
                try:
                    prompts.append(render_chat(tokenizer, conv, chat_template, add_generation_prompt,
                                               continue_final_message=continue_final_message, tools=tools,
                                               chat_template_kwargs=chat_template_kwargs,
                                               content_format=chat_template_content_format))
                except ValueError as e:
                    raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, results, order, sink: list[RequestOutput], use_tqdm: bool) -> None:
        engine, lock = self.llm_engine, self._lock
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(results), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        prefill_rate = decode_rate = 0.0
        last_postfix = 0.0
        remaining = len(results)
        try:
            while remaining:
                with lock:  # another thread's step may already have filled the sink
                    if not sink:
                        engine.advance()
                        if not sink and not engine.has_unfinished():  # nothing runs, yet ours did not end
                            _aborted_elsewhere([rid for rid, i in order.items()
                                                if results[i] is None and not engine.has_request(rid)])
                    outs, sink[:] = sink[:], []
                    s = engine.last_step
                for out in outs:
                    if out.finished:
                        results[order[out.request_id]] = out
                        remaining -= 1
                        bar.update(1)
                if s.seconds > 0:
                    if s.prefill_tokens:
                        prefill_rate = s.prefill_tokens / s.seconds
                    if s.decode_tokens:
                        decode_rate = s.decode_tokens / s.seconds
                now = time.perf_counter()
                if use_tqdm and now - last_postfix > 0.2:
                    last_postfix = now
                    kv = self.kv_stats()
                    bar.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s, "
                                        f"KV {kv.usage:.0%}, hit {kv.hit_rate:.0%}", refresh=False)
        finally:
            bar.close()


# apply_chat_template's own arguments: chat_template_kwargs may not set them
_TEMPLATE_ARGUMENTS = ("conversation", "tokenize", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tools", "return_dict", "return_tensors")


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, *, continue_final_message: bool = False,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                content_format: str = "auto", tool_parser: str | None = None) -> dict:
    """One conversation -> {"prompt": text, "prompt_token_ids": ids} via the chat template.
    Content parts are joined into one string (message_text) unless content_format is
    "openai"; the other arguments are vLLM's (LLM.chat). tools reach a template that reads
    them as tools=, any other through the default system prompt in tool_parser's format
    (nanokv/tool_calls.py with_tools); history tool calls' arguments become dicts."""
    check_messages(conversation)
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {content_format!r}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True continues the last message, add_generation_prompt=True "
                         "opens a new one: set add_generation_prompt=False")
    if not isinstance(chat_template_kwargs, (dict, type(None))):
        raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    extra = dict(chat_template_kwargs or {})
    clash = [k for k in extra if k in _TEMPLATE_ARGUMENTS]
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash[0]!r}; pass it as chat()'s own argument")
    if content_format != "openai":
        conversation = [m if isinstance(m.get("content"), str) else {**m, "content": message_text(m.get("content"),
                                                                                                f"messages[{i}]")}
                        for i, m in enumerate(conversation)]
    if continue_final_message:
        extra["continue_final_message"] = True
    source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    conversation, tools = with_tools(conversation, tools, source, tool_parser)
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    except Exception as e:  # no template, malformed messages
        raise ValueError(f"cannot apply the chat template: {e}") from e
    check_text(text, "the rendered conversation")
    # the template already holds the special tokens: add none
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def check_messages(conversation) -> None:
    """ValueError unless conversation is a non-empty list of {"role": str, "content": ...}."""
    fix = 'pass a list of {"role": ..., "content": ...} dicts, e.g. [{"role": "user", "content": "Hi"}]'
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"a conversation must be a non-empty list of messages; {fix}")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or ("content" not in m
                                                                             and not m.get("tool_calls")):
            raise ValueError(f"message {i} is {m!r}; {fix}")
        content = m["content"]
        if isinstance(content, str):
            check_text(content, f"message {i}'s content")
        elif content is not None and not isinstance(content, list):
            raise ValueError(f"message {i}'s content must be a string or a list of text parts, got "
                             f"{type(content).__name__}")


def message_text(content, where: str) -> str:
    """A message's content as the chat template's string: a string as it is, None as "",
    OpenAI's content parts ([{"type": "text", "text": ...}]) joined with newlines (vLLM's
    rule for string templates). ValueError naming where for anything else (images, ...).
    LLM.chat and the server's chat route both read content through here."""
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(content, f"{where}'s content")
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            why = f"has type {kind!r}; nanokv takes text only" if isinstance(kind, str) and kind != "text" \
                else 'must be {"type": "text", "text": "..."}'
            raise ValueError(f"{where}.content[{j}] {why}")
        check_text(part["text"], f"{where}.content[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _as_conversations(messages) -> list:
    """chat()'s argument: one conversation (a list of message dicts) or a list of them."""
    if isinstance(messages, str):
        raise ValueError('chat() takes messages, not a string: use chat([{"role": "user", "content": '
                         '"..."}]), or generate() for plain text')
    if isinstance(messages, dict):
        raise ValueError('chat() takes a list of messages, got one dict: wrap it in a list, '
                         '[{"role": ..., "content": ...}]')
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError('chat() takes a non-empty list of {"role", "content"} messages, or a list of '
                         f"such lists; got {messages!r}")
    if all(isinstance(m, dict) for m in messages):
        return [messages]
    return list(messages)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    try:
        prompts = list(prompts)
    except TypeError:
        raise ValueError("prompts must be a str, a list of str, a list of token ids, a list of such lists, "
                         f"or dicts with 'prompt' / 'prompt_token_ids'; got {type(prompts).__name__}") from None
    if prompts and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(sampling_params, n: int) -> list[SamplingParams | None]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, dict):
        raise ValueError("sampling_params must be a SamplingParams, got a dict: use "
                         "SamplingParams(**{...})")
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                         f"{type(sampling_params).__name__}")
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; "
                         "pass one SamplingParams or one per prompt")
    return params


def _aborted_elsewhere(request_ids: list[str]) -> None:
    """A call's requests that the engine no longer knows but that never finished: another
    thread aborted them through llm_engine.abort(). Raise rather than wait for them forever."""
    if request_ids:
        raise RuntimeError(f"request {request_ids[0]!r}" + (f" and {len(request_ids) - 1} more" if len(request_ids) > 1
                           else "") + " of this call was aborted by another caller (llm_engine.abort)")


def _abort_all(engine: LLMEngine, request_ids: list[str]) -> None:
    """Abort every request, going on past one that fails (the first error is logged)."""
    for request_id in request_ids:
        try:
            engine.abort(request_id)
        except Exception:  # noqa: BLE001 - cleanup must reach every request
            logger.exception("aborting request %s failed", request_id)
