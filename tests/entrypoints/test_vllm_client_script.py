"""A client and dashboard written for `vllm serve`, run against `nanokv serve`: the calls of
vLLM's documentation (docs/serving/openai_compatible_server.md, the openai client examples in
examples/online_serving/, its extra sampling parameters), the routes a deployment probes, and
every series vLLM's Grafana dashboards (examples/online_serving/prometheus_grafana/grafana.json,
dashboards/grafana/*.json) and the Gateway API inference extension's endpoint picker read.

Each call is run in a counting harness and has an expected outcome: "ok" (it works, and its
answer is checked), or a refusal (the openai client's exception, a 4xx whose message names
the field, for what nanokv does not do: tool_choice auto without the server's flags; suffix, best_of
above n and beam search vLLM refuses too). The tally is printed; the test fails on any call
whose outcome differs from its expectation."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Callable

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from .conftest import serve, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "sk-vllm-client"
MAX_LEN = 256
PROMPT = "A robot may not injure a human being"
# vLLM's examples/online_serving/openai_chat_completion_client.py
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
            {"role": "user", "content": "Where was it played?"}]
USER = [{"role": "user", "content": "What is a KV cache?"}]
GREEDY = {"temperature": 0, "max_tokens": 8}


@dataclass
class Call:
    name: str
    fn: Callable[[], object]
    refusal: tuple[type, str] | None  # (the openai exception, a word its message holds); None: must work


CALLS: list[Call] = []


def call(name: str, refused: tuple[type, str] | None = None):
    def register(fn):
        CALLS.append(Call(name, fn, refused))
        return fn
    return register


def bad(field: str) -> tuple[type, str]:
    return (openai.BadRequestError, field)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve(model_dir, "--served-model-name", MODEL, "--max-model-len", str(MAX_LEN), "--api-key", KEY,
               "--enable-prompt-tokens-details", log_path=str(tmp_path_factory.mktemp("server") / "log"))


class Ctx:
    """What the calls use: the client, the server's URL, the tokenizer, the parsed /metrics."""
    client: object
    url: str
    tok: Callable
    detok: Callable
    families: dict | None


ctx = Ctx()


def completion(**kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("prompt", PROMPT)
    return ctx.client.completions.create(**kw)


def chat(**kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", USER)
    return ctx.client.chat.completions.create(**kw)


def stream_text(chunks, is_chat: bool) -> tuple[dict, object]:
    texts, usage = {}, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            piece = (ch.delta.content or "") if is_chat else ch.text
            texts[ch.index] = texts.get(ch.index, "") + piece
    return texts, usage


# ---- models -----------------------------------------------------------------------------------

@call("models.list")
def _():
    ids = [m.id for m in ctx.client.models.list().data]
    assert ids == [MODEL], ids


@call("models.retrieve")
def _():
    m = ctx.client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"


@call("models.retrieve of an unknown model", (openai.NotFoundError, "nope"))
def _():
    ctx.client.models.retrieve("nope")


@call("models.list with a wrong key", (openai.AuthenticationError, ""))
def _():
    openai.OpenAI(base_url=ctx.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ---- completions ------------------------------------------------------------------------------

@call("completions: the example (echo=False, stream)")
def _():
    texts, _ = stream_text(completion(echo=False, stream=True, max_tokens=8), False)
    assert list(texts) == [0]


@call("completions: plain")
def _():
    r = completion(max_tokens=8)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8


@call("completions: greedy is deterministic")
def _():
    assert completion(**GREEDY).choices[0].text == completion(**GREEDY).choices[0].text


@call("completions: n=2")
def _():
    assert [c.index for c in completion(n=2, max_tokens=4).choices] == [0, 1]


@call("completions: best_of equal to n")
def _():
    assert len(completion(n=2, best_of=2, max_tokens=4).choices) == 2


@call("completions: best_of above n", bad("best_of"))
def _():
    completion(n=1, best_of=3, max_tokens=4)


@call("completions: logprobs=3")
def _():
    lp = completion(logprobs=3, **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    # keyed by text: tokens that decode alike (partial characters) share an entry, as in vLLM
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)


@call("completions: logprobs=0")
def _():
    lp = completion(logprobs=0, **GREEDY).choices[0].logprobs
    assert lp.token_logprobs and all(x <= 0 for x in lp.token_logprobs)


@call("completions: stop list")
def _():
    completion(stop=["\n", "."], max_tokens=16)


@call("completions: stop string")
def _():
    r = completion(stop="e", max_tokens=16, temperature=0)
    assert "e" not in r.choices[0].text


@call("completions: seed reproduces")
def _():
    a = completion(seed=42, temperature=1.0, max_tokens=8).choices[0].text
    assert a == completion(seed=42, temperature=1.0, max_tokens=8).choices[0].text


@call("completions: top_p")
def _():
    completion(top_p=0.9, temperature=0.8, max_tokens=8)


@call("completions: presence and frequency penalties")
def _():
    completion(presence_penalty=0.5, frequency_penalty=0.5, max_tokens=8)


@call("completions: stream with include_usage")
def _():
    texts, usage = stream_text(completion(stream=True, stream_options={"include_usage": True}, **GREEDY), False)
    assert usage is not None and usage.completion_tokens >= 1
    assert texts[0] == completion(**GREEDY).choices[0].text


@call("completions: stream n=2")
def _():
    texts, _ = stream_text(completion(stream=True, n=2, max_tokens=4), False)
    assert sorted(texts) == [0, 1]


@call("completions: stream with logprobs")
def _():
    got = [c.choices[0].logprobs for c in completion(stream=True, logprobs=2, **GREEDY) if c.choices]
    assert any(lp is not None and lp.tokens for lp in got)


@call("completions: a list of prompts")
def _():
    assert len(completion(prompt=["Hello", "The sky is"], max_tokens=4).choices) == 2


@call("completions: token ids")
def _():
    r = completion(prompt=[5, 6, 7, 8], max_tokens=4)
    assert r.usage.prompt_tokens == 4


@call("completions: a list of token-id lists")
def _():
    assert len(completion(prompt=[[5, 6], [7, 8, 9]], max_tokens=4).choices) == 2


@call("completions: user")
def _():
    completion(user="user-1", max_tokens=4)


@call("completions: suffix", bad("suffix"))
def _():
    completion(suffix="the end", max_tokens=4)


@call("completions: echo=True")
def _():
    r = completion(echo=True, **GREEDY)
    plain = completion(**GREEDY).choices[0].text
    assert r.choices[0].text == PROMPT + plain, r.choices[0].text


@call("completions: echo=True streamed")
def _():
    texts, _ = stream_text(completion(echo=True, stream=True, **GREEDY), False)
    assert texts[0].startswith(PROMPT)


@call("completions: echo=True with token ids")
def _():
    r = completion(prompt=[5, 6, 7], echo=True, max_tokens=2, temperature=0)
    assert r.choices[0].text.startswith(ctx.detok([5, 6, 7]))


@call("completions: top_k (extra_body)")
def _():
    completion(max_tokens=8, extra_body={"top_k": 5})


@call("completions: min_p")
def _():
    completion(max_tokens=8, extra_body={"min_p": 0.1})


@call("completions: repetition_penalty")
def _():
    completion(max_tokens=8, extra_body={"repetition_penalty": 1.2})


@call("completions: min_tokens with ignore_eos")
def _():
    r = completion(max_tokens=6, extra_body={"min_tokens": 6, "ignore_eos": True})
    assert r.usage.completion_tokens == 6


@call("completions: skip_special_tokens=False")
def _():
    completion(max_tokens=8, extra_body={"skip_special_tokens": False})


@call("completions: include_stop_str_in_output")
def _():
    r = completion(stop=["e"], temperature=0, max_tokens=32, extra_body={"include_stop_str_in_output": True})
    if r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == "e":
        assert r.choices[0].text.endswith("e")


@call("completions: stop_token_ids")
def _():
    first = completion(**GREEDY)
    token = ctx.tok(first.choices[0].text)[0]
    r = completion(extra_body={"stop_token_ids": [token]}, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == token


@call("completions: spaces_between_special_tokens")
def _():
    completion(max_tokens=8, extra_body={"spaces_between_special_tokens": False})


@call("completions: truncate_prompt_tokens")
def _():
    r = completion(max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3, r.usage


@call("completions: return_tokens_as_token_ids")
def _():
    lp = completion(logprobs=1, extra_body={"return_tokens_as_token_ids": True}, **GREEDY).choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens)


@call("completions: return_token_ids")
def _():
    r = completion(extra_body={"return_token_ids": True}, **GREEDY)
    assert r.choices[0].prompt_token_ids == ctx.tok(PROMPT)
    assert len(r.choices[0].token_ids) == r.usage.completion_tokens


@call("chat: return_token_ids")
def _():
    r = chat(extra_body={"return_token_ids": True}, **GREEDY)
    assert len(r.prompt_token_ids) == r.usage.prompt_tokens
    assert len(r.choices[0].token_ids) == r.usage.completion_tokens


@call("completions: add_special_tokens")
def _():
    completion(max_tokens=4, extra_body={"add_special_tokens": False})


@call("completions: request_id and priority (extra_body)")
def _():
    completion(max_tokens=4, extra_body={"request_id": "my-id-1", "priority": 0})


@call("completions: cached tokens in usage")
def _():
    long = PROMPT * 6
    completion(prompt=long, max_tokens=2)
    assert completion(prompt=long, max_tokens=2).usage.prompt_tokens_details.cached_tokens > 0


@call("completions: logit_bias")
def _():
    assert completion(logit_bias={"5": 100}, max_tokens=4, extra_body={"return_token_ids": True}
                      ).choices[0].token_ids == [5] * 4


@call("completions: prompt_logprobs")
def _():
    r = completion(max_tokens=4, extra_body={"prompt_logprobs": 1})
    assert r.choices[0].prompt_logprobs[0] is None and len(r.choices[0].prompt_logprobs) == r.usage.prompt_tokens


@call("completions: response_format json_object")
def _():
    completion(max_tokens=4, extra_body={"response_format": {"type": "json_object"}})


@call("completions: structured_outputs")
def _():
    completion(max_tokens=4, extra_body={"structured_outputs": {"choice": ["a", "b"]}})


@call("completions: guided_choice")
def _():
    completion(max_tokens=4, extra_body={"guided_choice": ["a", "b"]})


@call("completions: use_beam_search", bad("use_beam_search"))
def _():
    completion(max_tokens=4, extra_body={"use_beam_search": True})


@call("completions: allowed_token_ids")
def _():
    ids = completion(max_tokens=4, extra_body={"allowed_token_ids": [5, 6], "return_token_ids": True}
                     ).choices[0].token_ids
    assert set(ids) <= {5, 6}


@call("completions: max_tokens above max_model_len", bad("max_tokens"))
def _():
    completion(max_tokens=MAX_LEN + 1)


@call("completions: a negative temperature", bad("temperature"))
def _():
    completion(temperature=-1, max_tokens=4)


@call("completions: a prompt longer than max_model_len", bad("prompt"))
def _():
    completion(prompt=[5] * (MAX_LEN + 1), max_tokens=4)


@call("completions: an unknown model", (openai.NotFoundError, "does not exist"))
def _():
    completion(model="gpt-3.5-turbo-instruct", max_tokens=4)


@call("completions: with_raw_response")
def _():
    raw = ctx.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert raw.http_response.status_code == 200 and raw.parse().choices


@call("completions: the response's id, object, created, model")
def _():
    r = completion(max_tokens=2)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0 and r.model == MODEL


@call("completions: five stop strings and temperature 2")
def _():
    completion(stop=["a", "b", "c", "d", "e"], temperature=2.0, max_tokens=4)


@call("completions: continuous_usage_stats")
def _():
    chunks = list(completion(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                             max_tokens=4))
    assert all(c.usage is not None for c in chunks)


# ---- chat completions -------------------------------------------------------------------------

@call("chat: the example conversation")
def _():
    r = chat(messages=MESSAGES)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"


@call("chat: max_tokens")
def _():
    assert chat(max_tokens=5).usage.completion_tokens <= 5


@call("chat: max_completion_tokens")
def _():
    assert chat(max_completion_tokens=3).usage.completion_tokens <= 3


@call("chat: greedy is deterministic")
def _():
    assert chat(**GREEDY).choices[0].message.content == chat(**GREEDY).choices[0].message.content


@call("chat: n=2")
def _():
    assert len(chat(n=2, max_tokens=4).choices) == 2


@call("chat: stop")
def _():
    chat(stop=["\n"], max_tokens=16)


@call("chat: seed")
def _():
    a = chat(seed=7, temperature=1.0, max_tokens=8).choices[0].message.content
    assert a == chat(seed=7, temperature=1.0, max_tokens=8).choices[0].message.content


@call("chat: logprobs with top_logprobs")
def _():
    lp = chat(logprobs=True, top_logprobs=3, **GREEDY).choices[0].logprobs
    assert lp.content and all(len(t.top_logprobs) == 3 for t in lp.content)


@call("chat: logprobs alone")
def _():
    lp = chat(logprobs=True, **GREEDY).choices[0].logprobs
    assert lp.content and lp.content[0].logprob <= 0


@call("chat: top_logprobs without logprobs", bad("top_logprobs"))
def _():
    chat(top_logprobs=2, max_tokens=4)


@call("chat: stream")
def _():
    texts, _ = stream_text(chat(stream=True, **GREEDY), True)
    assert texts[0] == chat(**GREEDY).choices[0].message.content


@call("chat: stream with include_usage")
def _():
    _, usage = stream_text(chat(stream=True, stream_options={"include_usage": True}, max_tokens=4), True)
    assert usage is not None and usage.prompt_tokens > 0


@call("chat: stream with logprobs")
def _():
    got = [c.choices[0].logprobs for c in chat(stream=True, logprobs=True, top_logprobs=2, **GREEDY)
           if c.choices and c.choices[0].logprobs]
    assert got


@call("chat: stream n=2")
def _():
    texts, _ = stream_text(chat(stream=True, n=2, max_tokens=4), True)
    assert sorted(texts) == [0, 1]


@call("chat: content parts")
def _():
    chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                 {"type": "text", "text": "there"}]}], max_tokens=4)


@call("chat: a system prompt in parts")
def _():
    chat(messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER], max_tokens=4)


@call("chat: a developer message")
def _():
    chat(messages=[{"role": "developer", "content": "Be brief."}, *USER], max_tokens=4)


@call("chat: a message with a name")
def _():
    chat(messages=[{"role": "user", "content": "Hi", "name": "alice"}], max_tokens=4)


@call("chat: temperature and top_p")
def _():
    chat(temperature=0.7, top_p=0.9, max_tokens=4)


@call("chat: presence and frequency penalties")
def _():
    chat(presence_penalty=1.0, frequency_penalty=-0.5, max_tokens=4)


@call("chat: user, store, metadata, parallel_tool_calls")
def _():
    chat(user="u", store=False, metadata={"k": "v"}, parallel_tool_calls=False, max_tokens=4)


@call("chat: response_format text")
def _():
    chat(response_format={"type": "text"}, max_tokens=4)


@call("chat: response_format json_object")
def _():
    chat(response_format={"type": "json_object"}, max_tokens=4)


@call("chat: response_format json_schema")
def _():
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
         max_tokens=4)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


@call("chat: tools (tool_choice auto) without --enable-auto-tool-choice", bad("tool_choice"))
def _():
    chat(tools=TOOLS, max_tokens=4)


@call("chat: tools with tool_choice required")
def _():
    chat(tools=TOOLS, tool_choice="required", max_tokens=4)


@call("chat: tool_choice none without tools")
def _():
    chat(tool_choice="none", max_tokens=4)


@call("chat: an image part", bad("image"))
def _():
    chat(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                 {"type": "image_url",
                                                  "image_url": {"url": "https://example.com/a.png"}}]}],
         max_tokens=4)


@call("chat: logit_bias")
def _():
    chat(logit_bias={"5": 1}, max_tokens=4)


@call("chat: top_k, min_p, repetition_penalty (extra_body)")
def _():
    chat(max_tokens=4, extra_body={"top_k": 10, "min_p": 0.05, "repetition_penalty": 1.1})


@call("chat: min_tokens, ignore_eos")
def _():
    assert chat(max_tokens=5, extra_body={"min_tokens": 5, "ignore_eos": True}).usage.completion_tokens == 5


@call("chat: skip_special_tokens, spaces_between_special_tokens")
def _():
    chat(max_tokens=4, extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False})


@call("chat: include_stop_str_in_output, stop_token_ids")
def _():
    chat(max_tokens=8, stop=["a"], extra_body={"include_stop_str_in_output": True, "stop_token_ids": [0]})


@call("chat: truncate_prompt_tokens")
def _():
    r = chat(messages=MESSAGES, max_tokens=2, extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10, r.usage


@call("chat: add_generation_prompt=False")
def _():
    chat(max_tokens=4, extra_body={"add_generation_prompt": False})


@call("chat: continue_final_message")
def _():
    r = chat(messages=[*USER, {"role": "assistant", "content": "A KV cache is"}], max_tokens=4,
             extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.role == "assistant"


@call("chat: chat_template_kwargs")
def _():
    chat(max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})


@call("chat: echo=True")
def _():
    r = chat(messages=[*USER, {"role": "assistant", "content": "A KV cache is"}], **GREEDY,
             extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.content.startswith("A KV cache is"), r.choices[0].message.content


@call("chat: return_tokens_as_token_ids")
def _():
    lp = chat(logprobs=True, **GREEDY, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(t.token.startswith("token_id:") for t in lp.content)


@call("chat: request_id, priority, add_special_tokens (extra_body)")
def _():
    chat(max_tokens=4, extra_body={"request_id": "abc", "priority": 0, "add_special_tokens": False})


@call("chat: structured_outputs")
def _():
    chat(max_tokens=4, extra_body={"structured_outputs": {"regex": "[a-z]+"}})


@call("chat: guided_json")
def _():
    chat(max_tokens=4, extra_body={"guided_json": {"type": "object"}})


@call("chat: an unknown model", (openai.NotFoundError, "does not exist"))
def _():
    chat(model="gpt-4o", max_tokens=4)


@call("chat: no messages", bad("messages"))
def _():
    chat(messages=[], max_tokens=4)


@call("chat: frequency_penalty out of range", bad("frequency_penalty"))
def _():
    chat(frequency_penalty=5, max_tokens=4)


@call("chat: n=0", bad("n"))
def _():
    chat(n=0, max_tokens=4)


@call("chat: with_raw_response headers")
def _():
    raw = ctx.client.chat.completions.with_raw_response.create(model=MODEL, messages=USER, max_tokens=2)
    assert raw.headers["content-type"].startswith("application/json")


def async_client():
    """One per event loop (asyncio.run): its connections belong to the loop."""
    return openai.AsyncOpenAI(base_url=ctx.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


@call("chat: AsyncOpenAI, 4 at once")
def _():
    async def go():
        aclient = async_client()
        replies = await asyncio.gather(*[aclient.chat.completions.create(model=MODEL, messages=USER,
                                                                             max_tokens=4) for _ in range(4)])
        return [r.choices[0].message.content is not None for r in replies]
    assert all(asyncio.run(go()))


@call("chat: AsyncOpenAI stream")
def _():
    async def go():
        text = ""
        async for c in await async_client().chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                                                  stream=True):
            text += c.choices[0].delta.content or "" if c.choices else ""
        return text
    asyncio.run(go())


@call("chat: the response's id, object, model, usage")
def _():
    r = chat(max_tokens=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@call("chat: an assistant message with null content in the history")
def _():
    chat(messages=[*USER, {"role": "assistant", "content": None}, {"role": "user", "content": "Go on"}],
         max_tokens=2)


@call("chat: stream chunks (object, role first, finish_reason last)")
def _():
    chunks = list(chat(stream=True, max_tokens=3))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


# ---- the other routes (httpx) -----------------------------------------------------------------

def http(method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, ctx.url + path, timeout=30, **kw)


@call("GET /health")
def _():
    assert http("GET", "/health").status_code == 200


@call("GET /ping")
def _():
    assert http("GET", "/ping").status_code == 200


@call("POST /ping")
def _():
    assert http("POST", "/ping").status_code == 200


@call("GET /version")
def _():
    assert "version" in http("GET", "/version").json()


@call("POST /tokenize (prompt)")
def _():
    r = http("POST", "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN


@call("POST /tokenize (messages)")
def _():
    r = http("POST", "/tokenize", json={"model": MODEL, "messages": USER, "add_generation_prompt": True}).json()
    assert r["count"] > 0


@call("POST /detokenize")
def _():
    tokens = http("POST", "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert http("POST", "/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"] == "Hello world"


@call("GET /v1/models (httpx, Bearer)")
def _():
    r = http("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.json()["data"][0]["max_model_len"] == MAX_LEN


@call("POST /v1/completions without the key", (httpx.HTTPStatusError, "401"))
def _():
    http("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi"}).raise_for_status()


@call("POST /v1/chat/completions (curl's body)")
def _():
    r = http("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
             json={"model": MODEL, "messages": USER, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


@call("POST /v1/completions streamed (raw SSE)")
def _():
    with httpx.stream("POST", ctx.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


@call("GET /v1/models: vLLM's model card")
def _():
    card = http("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(card), card


@call("GET /metrics: Prometheus text")
def _():
    r = http("GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


@call("GET /docs")
def _():
    assert http("GET", "/docs").status_code == 200


@call("GET /openapi.json")
def _():
    assert "/v1/chat/completions" in http("GET", "/openapi.json").json()["paths"]


@call("GET /redoc")
def _():
    assert http("GET", "/redoc").status_code == 200


# ---- the metrics a dashboard and the Gateway API inference extension read ---------------------

def _families() -> dict:
    if ctx.families is None:
        wait_idle(ctx.url)
        text = http("GET", "/metrics").text
        ctx.families = {f.name: f for f in text_string_to_metric_families(text)}
    return ctx.families


# (metric family, type) for each series the dashboards' PromQL reads (vLLM's grafana.json, old
# and current, and dashboards/grafana/{performance,query}_statistics.json, which spell
# vllm: as vllm_) and the Gateway API inference extension's endpoint picker scrapes
SERIES = [
    ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"), ("vllm:time_per_output_token_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"), ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
    ("vllm:time_to_first_token_seconds", "histogram"), ("vllm:gpu_cache_usage_perc", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"), ("vllm:request_success", "counter"),
    ("vllm:request_queue_time_seconds", "histogram"), ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"), ("vllm:request_max_num_generation_tokens", "histogram"),
    ("vllm:iteration_tokens_total", "histogram"), ("vllm:lora_requests_info", "gauge"),
    ("vllm:cache_config_info", "gauge"), ("vllm:num_preemptions", "counter"),
    ("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"),
    ("vllm:request_inference_time_seconds", "histogram"), ("vllm:request_params_n", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"),
]


def _metric_call(name: str, kind: str):
    def check():
        family = _families().get(name)
        assert family is not None, f"{name} missing"
        assert family.type == kind, (name, family.type)
        samples = {s.name for s in family.samples}
        want = {"histogram": {name + "_bucket", name + "_sum", name + "_count"},
                "counter": {name + "_total"}, "gauge": {name}}[kind]
        assert want <= samples, (name, samples)
        if name not in ("vllm:cache_config_info", "vllm:lora_requests_info"):
            assert all(s.labels.get("model_name") == MODEL for s in family.samples), name
    return check


for _name, _kind in SERIES:
    call(f"metric {_name} ({_kind})")(_metric_call(_name, _kind))


@call("metric vllm:request_success_total by finished_reason")
def _():
    reasons = {s.labels["finished_reason"] for s in _families()["vllm:request_success"].samples}
    assert {"stop", "length"} <= reasons, reasons


@call("metric vllm:cache_config_info labels (block_size, num_gpu_blocks)")
def _():
    labels = _families()["vllm:cache_config_info"].samples[0].labels
    assert int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0, labels


@call("metric vllm:lora_requests_info labels (max_lora, running/waiting adapters)")
def _():
    labels = _families()["vllm:lora_requests_info"].samples[0].labels
    assert {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= set(labels), labels


@call("metric label_values({__name__=~\"vllm:.*\"}, model_name)")
def _():
    names = {s.labels.get("model_name") for f in _families().values() if f.name.startswith("vllm:")
             for s in f.samples} - {None}
    assert names == {MODEL}, names


@call("metric counts add up (prompt tokens, requests)")
def _():
    f = _families()
    prompt = sum(s.value for s in f["vllm:prompt_tokens"].samples if s.name.endswith("_total"))
    finished = sum(s.value for s in f["vllm:request_success"].samples if s.name.endswith("_total"))
    e2e = sum(s.value for s in f["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_count"))
    assert prompt > 0 and finished >= e2e > 0, (prompt, finished, e2e)


# ---- the harness ------------------------------------------------------------------------------

def run(c: Call) -> tuple[str, str]:
    """("pass" | "refused" | "fail", detail)."""
    try:
        c.fn()
    except Exception as e:  # noqa: BLE001 - every outcome is counted
        message = f"{type(e).__name__}: {e}"
        if c.refusal is not None and isinstance(e, c.refusal[0]) and c.refusal[1] in str(e):
            return "refused", message[:160]
        return "fail", message[:400]
    if c.refusal is not None:
        return "fail", f"worked, but {c.refusal[0].__name__} naming {c.refusal[1]!r} was expected"
    return "pass", ""


@pytest.fixture(scope="module")
def clients(server, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ctx.url = server.url
    ctx.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    ctx.tok = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    ctx.detok = tokenizer.decode
    ctx.families = None
    return ctx


def test_a_vllm_client_and_dashboard_work(clients):
    results = [(c, *run(c)) for c in CALLS]
    tally = {k: sum(1 for _, outcome, _ in results if outcome == k) for k in ("pass", "refused", "fail")}
    print(f"\n{len(results)} calls: {tally['pass']} passed, {tally['refused']} refused as expected, "
          f"{tally['fail']} failed")
    for c, outcome, detail in results:
        if outcome != "pass":
            print(f"  {outcome:8} {c.name}: {detail}")
    assert len(results) >= 120
    assert not [c.name for c, outcome, _ in results if outcome == "fail"]


# ---- the server fixes the script called for, one behaviour each --------------------------------

def test_completions_echo_puts_each_prompt_before_its_answers(clients):
    plain = completion(**GREEDY).choices[0].text
    assert completion(echo=True, **GREEDY).choices[0].text == PROMPT + plain
    texts, _ = stream_text(completion(echo=True, stream=True, **GREEDY), False)
    assert texts == {0: PROMPT + plain}
    ids = [5, 6, 7]
    plain_ids = completion(prompt=ids, **GREEDY).choices[0].text
    assert completion(prompt=ids, echo=True, **GREEDY).choices[0].text == clients.detok(ids) + plain_ids
    two = completion(prompt=["Hi", PROMPT], n=2, echo=True, **GREEDY).choices
    assert [c.text.startswith(p) for c, p in zip(two, ["Hi", "Hi", PROMPT, PROMPT])] == [True] * 4
    r = completion(echo=True, logprobs=1, **GREEDY)  # the prompt's logprobs first, then the answer's
    assert r.choices[0].text == PROMPT + plain and r.choices[0].logprobs.token_logprobs[0] is None
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_echo_starts_the_answer_with_a_continued_message(clients):
    start = [*USER, {"role": "assistant", "content": "A KV cache is"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(messages=start, **GREEDY, extra_body=cont).choices[0].message.content
    echoed = chat(messages=start, **GREEDY, extra_body={**cont, "echo": True}).choices[0].message.content
    assert echoed == "A KV cache is" + plain
    texts, _ = stream_text(chat(messages=start, stream=True, **GREEDY, extra_body={**cont, "echo": True}), True)
    assert texts == {0: "A KV cache is" + plain}
    # a new assistant message (the last one is the user's): nothing to echo, as in vLLM
    assert (chat(**GREEDY, extra_body={"echo": True}).choices[0].message.content
            == chat(**GREEDY).choices[0].message.content)


def test_truncate_prompt_tokens_keeps_the_last_tokens(clients):
    ids = clients.tok(PROMPT)
    r = completion(extra_body={"truncate_prompt_tokens": 3}, **GREEDY)
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == completion(prompt=ids[-3:], **GREEDY).choices[0].text
    long = completion(prompt=[5] * (MAX_LEN + 20), extra_body={"truncate_prompt_tokens": 10}, max_tokens=2)
    assert long.usage.prompt_tokens == 10
    assert chat(messages=MESSAGES, max_tokens=2, extra_body={"truncate_prompt_tokens": 7}).usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens") as e:
        completion(extra_body={"truncate_prompt_tokens": MAX_LEN + 1}, max_tokens=2)
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_spaces_between_special_tokens_reaches_the_sampling_params(model_dir):
    from nanokv.entrypoints.openai.protocol import Limits, parse_chat, parse_completion
    from nanokv.entrypoints.openai.settings import ServerSettings
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings, limits = ServerSettings(model_names=(MODEL,)), Limits.of(tokenizer, MAX_LEN)
    body = {"spaces_between_special_tokens": False}
    assert parse_completion({"prompt": "x", **body}, settings, limits).params.spaces_between_special_tokens is False
    chat_req = parse_chat({"messages": USER, **body}, settings, tokenizer, limits)
    assert chat_req.params.spaces_between_special_tokens is False
    assert parse_completion({"prompt": "x"}, settings, limits).params.spaces_between_special_tokens is True


def test_add_special_tokens_as_vllm(model_dir):
    """Completions add the tokenizer's special tokens (a BOS) unless add_special_tokens is
    false; chat adds none (the template holds them) unless it is true."""
    from nanokv import LLM
    from nanokv.llm import render_chat

    from .test_vllm_server import exchange, post, with_bos

    offline = LLM(model_dir, max_model_len=MAX_LEN, kv_cache_memory_bytes=16 << 20)
    tok = with_bos(offline.get_tokenizer())
    text = "Hello there"
    r = exchange(offline, [
        post("/v1/completions", {"prompt": text, "max_tokens": 1}),
        post("/v1/completions", {"prompt": text, "max_tokens": 1, "add_special_tokens": False}),
        post("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
        post("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "add_special_tokens": True}),
        post("/v1/completions", {"prompt": text, "add_special_tokens": "no"}),
    ], tokenizer=tok)
    prompt_tokens = [x.json()["usage"]["prompt_tokens"] for x in r[:4]]
    rendered = render_chat(tok, USER)["prompt"]
    assert prompt_tokens == [len(tok(text).input_ids), len(tok(text, add_special_tokens=False).input_ids),
                             len(tok(rendered, add_special_tokens=False).input_ids), len(tok(rendered).input_ids)]
    assert prompt_tokens[0] == prompt_tokens[1] + 1 and prompt_tokens[3] == prompt_tokens[2] + 1
    assert r[4].status_code == 400 and r[4].json()["error"]["param"] == "add_special_tokens"


def test_return_token_ids_as_vllm(clients):
    """vLLM's return_token_ids: each choice's token ids (streamed: each chunk's new ones), and
    the prompt's ids (completions: on the choice, streamed on its first chunk; chat: on the
    response, streamed on the first chunk)."""
    ids = {"return_token_ids": True}
    whole = completion(prompt=["Hi", PROMPT], n=2, extra_body=ids, **GREEDY)
    assert [c.prompt_token_ids for c in whole.choices] == [clients.tok("Hi")] * 2 + [clients.tok(PROMPT)] * 2
    assert [clients.detok(c.token_ids) for c in whole.choices] == [c.text for c in whole.choices]
    chunks = [c for c in completion(stream=True, extra_body=ids, **GREEDY)]
    assert [c.choices[0].prompt_token_ids for c in chunks if getattr(c.choices[0], "prompt_token_ids", None)] \
        == [clients.tok(PROMPT)]
    streamed = [t for c in chunks for t in c.choices[0].token_ids]
    assert streamed == completion(extra_body=ids, **GREEDY).choices[0].token_ids
    assert not hasattr(completion(**GREEDY).choices[0], "token_ids") or \
        completion(**GREEDY).choices[0].token_ids is None
    tokens = httpx.post(clients.url + "/tokenize", json={"messages": USER}, timeout=30).json()["tokens"]
    r = chat(extra_body=ids, **GREEDY)
    assert r.prompt_token_ids == tokens and clients.detok(r.choices[0].token_ids) == r.choices[0].message.content
    chunks = list(chat(stream=True, extra_body=ids, **GREEDY))
    assert chunks[0].prompt_token_ids == tokens
    assert [t for c in chunks[1:] for t in (c.choices[0].token_ids or [])] == r.choices[0].token_ids
