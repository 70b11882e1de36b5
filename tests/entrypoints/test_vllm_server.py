"""What a client or a deployment script written for `vllm serve` meets: /tokenize and
/detokenize with vLLM's bodies, /ping, /version, /docs and /openapi.json, vLLM's 404 for
an unknown model, VLLM_API_KEY, and the serve flags (--chat-template, --response-role,
--return-tokens-as-token-ids, CORS methods and headers, request logs, the access log,
underscore spellings and JSON lists). In process through httpx's ASGI transport where
the app is enough; one `nanokv serve` subprocess pair for what only a process shows."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import re
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.async_llm import AsyncLLM  # noqa: E402
from nanokv.entrypoints.cli import main  # noqa: E402
from nanokv.entrypoints.openai import api_server  # noqa: E402
from nanokv.entrypoints.openai.api_server import ServerSettings, build_app  # noqa: E402
from nanokv.llm import render_chat  # noqa: E402
from nanokv.llm_engine import LLMEngine  # noqa: E402
from nanokv.tool_calls import tools_system_prompt  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
# a template unlike the tokenizer's (Qwen's <|im_start|> turns), so its use shows in the tokens
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[bot]{% endif %}")


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, max_model_len=256)


def serve_app(offline, tokenizer=None, **settings) -> tuple[AsyncLLM, object]:
    config = dataclasses.replace(offline.llm_engine.config, max_num_seqs=8)
    llm = AsyncLLM(LLMEngine(config, tokenizer=tokenizer or offline.get_tokenizer()))
    return llm, build_app(llm, ServerSettings(model_names=(MODEL,), **settings))


def exchange(offline, requests: list, *, settings: dict | None = None, base: str = "http://test",
             tokenizer=None) -> list:
    """[(method, path, body (JSON, or raw JSON bytes) or None, headers)] -> the responses, on a
    fresh app."""
    llm, app = serve_app(offline, tokenizer, **(settings or {}))

    async def go():
        llm.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base) as http:
                return [await http.request(method, path, **(
                            {"content": body, "headers": {"Content-Type": "application/json", **(headers or {})}}
                            if isinstance(body, bytes) else {"json": body, "headers": headers or {}}))
                        for method, path, body, headers in requests]
        finally:
            llm.shutdown()

    return asyncio.run(asyncio.wait_for(go(), 120))


def post(path: str, body: dict, headers: dict | None = None) -> tuple:
    return ("POST", path, body, headers)


def get(path: str, headers: dict | None = None) -> tuple:
    return ("GET", path, None, headers)


def check_error(resp, status: int, error_type: str, param, match: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (error_type, status, param), error
    assert match in error["message"], error["message"]


# ---- /tokenize, /detokenize ----------------------------------------------------------------------

def with_bos(tokenizer):
    """A copy of the tiny tokenizer that starts every text with a BOS token when asked for
    special tokens (as Llama's does; the tiny ones add none, which would hide the flag)."""
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    bos = tok.convert_ids_to_tokens(1)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    assert tok("Hi").input_ids[0] == 1 and tok("Hi", add_special_tokens=False).input_ids[0] != 1
    return tok


def test_tokenize_and_detokenize_answer_as_the_tokenizer(offline):
    tok = with_bos(offline.get_tokenizer())
    text = "The capital of France is"
    conversation = render_chat(tok, CHAT)["prompt"]
    no_prompt = render_chat(tok, CHAT, add_generation_prompt=False)["prompt"]
    ids = tok(text).input_ids
    r = exchange(offline, [
        post("/tokenize", {"model": MODEL, "prompt": text}),
        post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}),
        post("/tokenize", {"model": MODEL, "messages": CHAT}),
        post("/tokenize", {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}),
        post("/detokenize", {"model": MODEL, "tokens": ids}),
        post("/detokenize", {"tokens": []}),
    ], tokenizer=tok)
    assert all(x.status_code == 200 for x in r), [x.text for x in r]
    assert r[0].json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    plain = tok(text, add_special_tokens=False).input_ids
    assert r[1].json() == {"count": len(plain), "max_model_len": 256, "tokens": plain,
                           "token_strs": tok.convert_ids_to_tokens(plain)}
    # a conversation: the template's special tokens only, unless add_special_tokens asks for more
    assert r[2].json()["tokens"] == tok(conversation, add_special_tokens=False).input_ids
    assert r[3].json()["tokens"] == tok(no_prompt, add_special_tokens=True).input_ids
    assert r[2].json()["tokens"] != r[3].json()["tokens"]
    assert r[4].json() == {"prompt": tok.decode(ids)}
    assert r[5].json() == {"prompt": ""}


def test_tokenize_and_detokenize_refuse_bad_bodies(offline):
    vocab = len(offline.get_tokenizer())
    r = exchange(offline, [
        post("/detokenize", {"tokens": [5, vocab]}),
        post("/detokenize", {"tokens": [-1]}),
        post("/detokenize", {"tokens": "5 6"}),
        post("/tokenize", {"prompt": 5}),
        post("/tokenize", {}),
        post("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}),
        post("/tokenize", {"messages": []}),
        post("/tokenize", {"messages": CHAT, "tools": {"type": "function"}}),
        post("/tokenize", {"prompt": "x", "return_token_strs": 1}),
        post("/tokenize", b'{"prompt": "ab\\udfff"}'),
        post("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ])
    check_error(r[0], 400, "BadRequestError", "tokens", f"not a token id: the vocabulary has ids 0 to {vocab - 1}")
    check_error(r[1], 400, "BadRequestError", "tokens", "not a token id")
    check_error(r[2], 400, "BadRequestError", "tokens", "list of token ids")
    check_error(r[3], 400, "BadRequestError", "prompt", '"messages"')
    check_error(r[4], 400, "BadRequestError", "prompt", '"messages"')
    check_error(r[5], 400, "BadRequestError", "add_special_tokens", "true or false")
    check_error(r[6], 400, "BadRequestError", "messages", "non-empty list")
    check_error(r[7], 400, "BadRequestError", "tools", "list of tool objects")
    check_error(r[8], 400, "BadRequestError", "return_token_strs", "true or false")
    check_error(r[9], 400, "BadRequestError", "prompt", "lone surrogate")
    check_error(r[10], 400, "BadRequestError", "messages", "lone surrogate")


def test_an_unknown_model_is_vllms_404_on_every_route(offline):
    r = exchange(offline, [
        post("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}),
        post("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}),
        post("/tokenize", {"model": "gpt-4", "prompt": "Hi"}),
        post("/detokenize", {"model": "gpt-4", "tokens": [5]}),
        get("/v1/models/gpt-4"),
        post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ])
    for resp in r[:5]:
        assert resp.status_code == 404
        assert resp.json() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}
    assert r[5].status_code == 200


# ---- /ping, /version, /docs, /openapi.json ---------------------------------------------------------

ROUTES = {"/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get", "/tokenize": "post",
          "/detokenize": "post", "/health": "get", "/ping": "get", "/metrics": "get", "/version": "get"}


def test_ping_version_docs_and_the_openapi_schema(offline):
    r = exchange(offline, [get("/ping"), ("POST", "/ping", None, None), get("/version"), get("/docs"),
                           get("/redoc"), get("/openapi.json")])
    assert [x.status_code for x in r] == [200] * 6
    import nanokv

    assert r[2].json() == {"version": nanokv.__version__}
    assert "swagger" in r[3].text.lower() and "/openapi.json" in r[3].text
    schema = r[5].json()
    for path, method in ROUTES.items():
        assert schema["paths"][path][method]["summary"], path
    assert "post" in schema["paths"]["/ping"]
    body = schema["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["example"]["prompt"] == "Hello"


def test_disable_fastapi_docs_removes_docs_and_schema(offline):
    r = exchange(offline, [get("/docs"), get("/redoc"), get("/openapi.json"), get("/version")],
                 settings={"docs": False})
    assert [x.status_code for x in r] == [404, 404, 404, 200]
    assert "/docs" not in r[0].json()["error"]["message"].partition("the routes are")[2]


def test_the_api_key_guards_v1_only_as_vllm(offline):
    key = {"Authorization": "Bearer sekrit"}
    r = exchange(offline, [post("/tokenize", {"prompt": "Hi"}), post("/detokenize", {"tokens": [5]}),
                           get("/ping"), get("/openapi.json"), get("/v1/models"), get("/v1/models", key)],
                 settings={"api_key": "sekrit"})
    assert [x.status_code for x in r] == [200, 200, 200, 200, 401, 200]


# ---- chat template, response role, token ids ----------------------------------------------------

def test_the_chat_template_serves_chat_completions_and_tokenize(offline):
    tok = offline.get_tokenizer()
    rendered = "[system] Be brief.\n[user] What is a KV cache?\n[bot]"
    ids = tok(rendered, add_special_tokens=False).input_ids
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=8), chat_template=TEMPLATE,
                            use_tqdm=False)[0].outputs[0].text
    greedy = {"temperature": 0, "max_tokens": 8}
    r = exchange(offline, [post("/tokenize", {"messages": CHAT}),
                           post("/v1/chat/completions", {"messages": CHAT, **greedy}),
                           post("/tokenize", {"messages": CHAT, "chat_template": "{{ 'x' }}"})],
                 settings={"chat_template": TEMPLATE})
    assert r[0].json()["tokens"] == ids
    answer = r[1].json()
    assert answer["usage"]["prompt_tokens"] == len(ids) and answer["choices"][0]["message"]["content"] == expected
    check_error(r[2], 400, "BadRequestError", "chat_template", "--trust-request-chat-template")

    # a request's own template, only when the server trusts requests' templates
    own = exchange(offline, [post("/tokenize", {"messages": CHAT, "chat_template": "{{ 'x' }}"}),
                             post("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 'x' }}",
                                                           "max_tokens": 1})],
                   settings={"chat_template": TEMPLATE, "trust_request_chat_template": True})
    assert own[0].json()["tokens"] == tok("x", add_special_tokens=False).input_ids
    assert own[1].json()["usage"]["prompt_tokens"] == len(own[0].json()["tokens"])


# a template that shows its variables: a kwarg, the generation prompt, the content's type
SHOWING = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
           "{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% endif %}{% if think %}<think>{% endif %}")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def test_template_options_continue_final_message_and_kwargs(offline):
    tok = offline.get_tokenizer()
    prefill = [*CHAT, {"role": "assistant", "content": "A KV cache"}]
    text = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    r = exchange(offline, [
        post("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"think": True}}),
        post("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"think": True}, "max_tokens": 1}),
        post("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}),
        post("/tokenize", {"messages": CHAT, "chat_template_kwargs": [1]}),
    ], settings={"chat_template": SHOWING})
    assert r[0].json()["tokens"] == text("<system>Be brief.<user>What is a KV cache?<assistant><think>")
    assert r[1].json()["usage"]["prompt_tokens"] == r[0].json()["count"]
    check_error(r[2], 400, "BadRequestError", "chat_template_kwargs", "chat_template")
    check_error(r[3], 400, "BadRequestError", "chat_template_kwargs", "an object")

    # the tokenizer's template closes a message (<|im_end|>); continuing it leaves it open
    no_prompt = {"messages": prefill, "add_generation_prompt": False}
    c = exchange(offline, [post("/tokenize", no_prompt),
                           post("/tokenize", {**no_prompt, "continue_final_message": True}),
                           post("/v1/chat/completions", {**no_prompt, "continue_final_message": True, "max_tokens": 1}),
                           post("/tokenize", {"messages": prefill, "continue_final_message": True})])
    open_ended = render_chat(tok, prefill, add_generation_prompt=False, continue_final_message=True)
    assert c[1].json()["tokens"] == open_ended["prompt_token_ids"] and open_ended["prompt"].endswith("A KV cache")
    assert c[0].json()["tokens"] != c[1].json()["tokens"]
    assert c[2].json()["usage"]["prompt_tokens"] == c[1].json()["count"]
    assert c[2].json()["choices"][0]["message"]["role"] == "assistant"  # the continued message's role
    check_error(c[3], 400, "BadRequestError", "continue_final_message", "add_generation_prompt")

    # --chat-template-content-format openai: the template reads OpenAI's parts, not one string
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "c"}]
    body = {"messages": parts, "add_generation_prompt": False}
    string = exchange(offline, [post("/tokenize", body)], settings={"chat_template": SHOWING})
    openai_parts = exchange(offline, [post("/tokenize", body),
                                      post("/tokenize", {**body, "tools": [TOOL]})],
                            settings={"chat_template": SHOWING, "chat_template_content_format": "openai"})
    assert string[0].json()["tokens"] == text("<user>a\nb<assistant>c")
    assert openai_parts[0].json()["tokens"] == text("<user>[a][b]<assistant>[c]")
    # a template that does not read tools gets them in the default system prompt, as a part here
    assert openai_parts[1].json()["tokens"] == text(f"<system>[{tools_system_prompt([TOOL])}]<user>[a][b]<assistant>[c]")


def test_the_response_role_names_the_answer(offline):
    body = {"messages": CHAT, "max_tokens": 3}
    prefill = {"messages": [*CHAT, {"role": "assistant", "content": "A cache"}], "max_tokens": 3,
               "add_generation_prompt": False}
    r = exchange(offline, [post("/v1/chat/completions", body),
                           post("/v1/chat/completions", {**body, "stream": True}),
                           post("/v1/chat/completions", prefill)],
                 settings={"response_role": "bot"})
    assert r[0].json()["choices"][0]["message"]["role"] == "bot"
    assert '"delta":{"role":"bot","content":""}' in r[1].text
    # no generation prompt: the answer continues the last message, so it has that message's role
    assert r[2].json()["choices"][0]["message"]["role"] == "assistant"
    default = exchange(offline, [post("/v1/chat/completions", body)])
    assert default[0].json()["choices"][0]["message"]["role"] == "assistant"


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(offline):
    tok = offline.get_tokenizer()
    completion = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    requests = [post("/v1/completions", completion), post("/v1/chat/completions", chat),
                post("/v1/completions", {**completion, "return_tokens_as_token_ids": False})]
    texts = exchange(offline, requests[:2])
    ids = exchange(offline, requests, settings={"return_tokens_as_token_ids": True})
    by_request = exchange(offline, [post("/v1/completions", {**completion, "return_tokens_as_token_ids": True})])

    def token_id(name: str) -> int:
        prefix, _, number = name.partition(":")
        assert prefix == "token_id", name
        return int(number)

    text_lp, id_lp = texts[0].json()["choices"][0]["logprobs"], ids[0].json()["choices"][0]["logprobs"]
    assert [tok.decode([token_id(t)]) for t in id_lp["tokens"]] == text_lp["tokens"]
    assert id_lp["token_logprobs"] == text_lp["token_logprobs"]
    assert id_lp["text_offset"] == text_lp["text_offset"]  # offsets stay offsets into the text
    assert [{tok.decode([token_id(k)]): v for k, v in top.items()} for top in id_lp["top_logprobs"]] == \
        text_lp["top_logprobs"]
    assert by_request[0].json()["choices"][0]["logprobs"] == id_lp
    assert ids[2].json()["choices"][0]["logprobs"] == text_lp  # the request's false wins

    text_chat, id_chat = texts[1].json()["choices"][0]["logprobs"], ids[1].json()["choices"][0]["logprobs"]
    for t, i in zip(text_chat["content"], id_chat["content"], strict=True):
        assert tok.decode([token_id(i["token"])]) == t["token"] and i["logprob"] == t["logprob"]
        assert i["bytes"] == list(i["token"].encode())
        assert [tok.decode([token_id(x["token"])]) for x in i["top_logprobs"]] == \
            [x["token"] for x in t["top_logprobs"]]


# ---- CORS, request logs --------------------------------------------------------------------------

def test_cors_methods_and_headers(offline):
    origin = "http://ui.example"

    def preflight(method: str, header: str) -> tuple:
        return ("OPTIONS", "/v1/completions", None, {"Origin": origin, "Access-Control-Request-Method": method,
                                                      "Access-Control-Request-Headers": header})

    asks = [preflight("POST", "authorization"), preflight("DELETE", "authorization"),
            preflight("GET", "x-custom"), preflight("GET", "x-other")]
    narrow = exchange(offline, asks, settings={"allowed_origins": (origin,), "allowed_methods": ("GET",),
                                               "allowed_headers": ("x-custom",)})
    assert [r.status_code for r in narrow] == [400, 400, 200, 400]
    assert narrow[2].headers["access-control-allow-origin"] == origin
    assert "GET" in narrow[2].headers["access-control-allow-methods"]
    assert "POST" not in narrow[2].headers["access-control-allow-methods"]
    wide = exchange(offline, asks, settings={"allowed_origins": (origin,)})  # vLLM's defaults: * and *
    assert [r.status_code for r in wide] == [200, 200, 200, 200]
    off = exchange(offline, asks[:1])  # no --allowed-origins: no CORS at all
    assert off[0].status_code == 403 and "access-control-allow-origin" not in off[0].headers


def test_enable_log_requests_logs_each_request_cut_to_max_log_len(offline, caplog):
    tok = offline.get_tokenizer()
    prompt = "The capital of France is"
    ids = tok(prompt).input_ids
    requests = [post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0}),
                post("/tokenize", {"prompt": prompt})]
    with caplog.at_level(logging.INFO, logger="nanokv"):
        exchange(offline, requests, settings={"log_requests": True, "max_log_len": 4})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("Received request cmpl-") and f"prompt: {prompt[:4]!r}, params: SamplingParams(" \
        in lines[0] and "max_tokens=2" in lines[0] and f"prompt_token_ids: {ids[:4]}." in lines[0]
    assert lines[1].startswith("Received request tokn-") and "params: None" in lines[1]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanokv"):
        exchange(offline, requests, settings={"log_requests": True})
        exchange(offline, requests)  # the default: no request lines
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    assert len(lines) == 2 and f"prompt: {prompt!r}" in lines[0] and f"prompt_token_ids: {ids}." in lines[0]


def test_tokenizer_info_endpoint(offline):
    tok = offline.get_tokenizer()
    on = exchange(offline, [get("/tokenizer_info")], settings={"tokenizer_info": True, "chat_template": TEMPLATE})
    info = on[0].json()
    assert info["tokenizer_class"] == type(tok).__name__ and info["chat_template"] == TEMPLATE
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == tok.model_max_length
    assert not any(k.endswith("_file") or k == "name_or_path" for k in info)  # no local paths
    off = exchange(offline, [get("/tokenizer_info")])
    assert off[0].status_code == 404


def test_the_periodic_stats_line(offline, caplog):
    from nanokv.entrypoints.openai.stats_log import StatsLog

    llm, app = serve_app(offline)

    async def go():
        llm.start()
        try:
            stats = StatsLog(llm, 1.0)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
                done = await http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4,
                                                                "ignore_eos": True})
            with caplog.at_level(logging.DEBUG, logger="nanokv"):
                for _ in range(3):
                    await stats.log()
            return done
        finally:
            llm.shutdown()

    done = asyncio.run(asyncio.wait_for(go(), 120))
    assert done.status_code == 200
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert [level for level, _ in lines] == [logging.INFO, logging.INFO, logging.DEBUG]  # traffic, once after, idle
    first = re.fullmatch(r"Avg prompt throughput: ([0-9.]+) tokens/s, Avg generation throughput: ([0-9.]+) "
                         r"tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                         r"Prefix cache hit rate: 0.0%", lines[0][1])
    assert first and float(first.group(1)) > 0 and float(first.group(2)) > 0, lines[0][1]
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s" in lines[1][1]


def test_request_id_headers(offline):
    asks = [post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, {"X-Request-Id": "abc-1"}),
            post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True}),
            post("/v1/completions", {"model": "nope", "prompt": "Hi"}, {"X-Request-Id": "abc-2"})]
    on = exchange(offline, asks, settings={"request_id_headers": True})
    assert [r.status_code for r in on] == [200, 200, 404]
    assert on[0].headers["x-request-id"] == "abc-1" and on[2].headers["x-request-id"] == "abc-2"
    assert len(on[1].headers["x-request-id"]) == 32 and "data: [DONE]" in on[1].text
    off = exchange(offline, asks[:1])
    assert "x-request-id" not in off[0].headers


# ---- the command line ----------------------------------------------------------------------------

@pytest.fixture
def settings_of(monkeypatch):
    """settings_of(argv) -> (ServerSettings, EngineArgs) `nanokv serve argv` would run with."""
    for name in ("NANOKV_API_KEY", "VLLM_API_KEY", "VLLM_LOG_STATS_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda engine_args, settings: seen.append((settings, engine_args)))

    def run(argv: list[str]):
        seen.clear()
        code = main(["serve", *argv])
        assert (code is None) == bool(seen) and code in (None, 2)
        return seen[0] if seen else None

    return run


def test_a_vllm_serve_command_line_parses(settings_of, tmp_path, monkeypatch, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    settings, engine = settings_of([
        "org/model", "--host", "0.0.0.0", "--port", "8001", "--api-key", "k", "--served-model-name", "m",
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.85", "--dtype", "bfloat16",
        "--tensor-parallel-size", "1", "--max-num-seqs", "64", "--enable-prefix-caching", "--uvicorn-log-level",
        "warning", "--seed", "7", "--disable-log-requests", "--max_num_batched_tokens", "1024", "--block_size=32",
        "--chat-template", str(template), "--response-role", "bot", "--allowed-origins", '["http://a.b"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", "x-one", "x-two", "--enable-log-requests",
        "--max-log-len", "100", "--disable-uvicorn-access-log", "--return-tokens-as-token-ids",
        "--disable-fastapi-docs", "--allow-credentials", "--trust-request-chat-template"])
    assert (settings.model_names, settings.host, settings.port, settings.api_key, settings.log_level) == \
        (("m",), "0.0.0.0", 8001, "k", "warning")
    assert (engine.model, engine.max_model_len, engine.gpu_memory_utilization, engine.dtype, engine.max_num_seqs,
            engine.seed, engine.max_num_batched_tokens, engine.kvcache_block_size) == \
        ("org/model", 4096, 0.85, "bfloat16", 64, 7, 1024, 32)
    assert settings.chat_template == TEMPLATE and settings.response_role == "bot"
    assert (settings.allowed_origins, settings.allowed_methods, settings.allowed_headers) == \
        (("http://a.b",), ("GET", "POST"), ("x-one", "x-two"))
    assert (settings.log_requests, settings.max_log_len, settings.access_log, settings.docs) == \
        (True, 100, False, False)
    assert settings.return_tokens_as_token_ids and settings.allow_credentials and settings.trust_request_chat_template

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    more, _ = settings_of(["org/model", "--enable-request-id-headers", "--disable-frontend-multiprocessing",
                           "--api-server-count", "1", "--chat-template-content-format", "openai",
                           "--enable-tokenizer-info-endpoint"])
    assert more.request_id_headers and more.tokenizer_info and more.chat_template_content_format == "openai"
    assert more.log_stats_interval == 2.5
    for bad in ("soon", "0"):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", bad)
        assert settings_of(["org/model"]) is None
        assert "VLLM_LOG_STATS_INTERVAL must be a" in capsys.readouterr().err
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL")

    defaults, _ = settings_of(["org/model"])
    assert defaults == ServerSettings(model_names=("org/model",))


def test_config_yaml_gives_flags_and_the_command_line_wins(settings_of, tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("model: org/model\nport: 8001\nmax_model_len: 1024\nenable-prefix-caching: false\n"
                      "enable_log_requests: true\ndisable-fastapi-docs: false\nserved-model-name: [m1, m2]\n"
                      "allowed-origins: ['http://a.b']\nresponse-role: bot\n")
    settings, engine = settings_of(["--config", str(config), "--port", "9000", "--response_role", "helper"])
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching) == ("org/model", 1024, False)
    assert (settings.port, settings.model_names, settings.allowed_origins) == (9000, ("m1", "m2"), ("http://a.b",))
    assert settings.log_requests and settings.docs and settings.response_role == "helper"
    positional, engine = settings_of(["org/model", f"--config={config}"])
    assert positional.port == 8001 and engine.model == "org/model"
    for text, match in (("- port\n", "expected a mapping"), ("port: [\n", "--config")):
        config.write_text(text)
        with pytest.raises(SystemExit):
            main(["serve", "--config", str(config)])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "none.yaml")])
    assert "No such file" in capsys.readouterr().err


def test_chat_template_values(settings_of, capsys):
    inline, _ = settings_of(["m", "--chat-template", "{% for m in messages %}{{ m.content }}\\n{% endfor %}"])
    assert inline.chat_template == "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert settings_of(["m", "--chat-template", "/no/such/template.jinja"]) is None
    assert "is not a file, nor a template" in capsys.readouterr().err
    assert settings_of(["m", "--chat-template", "{% for m in messages %}"]) is None
    assert "not a valid Jinja template" in capsys.readouterr().err


def test_vllm_api_key_is_honoured_after_nanokv_api_key(settings_of, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert settings_of(["m"])[0].api_key == "from-vllm"
    assert settings_of(["m", "--api-key", "flag"])[0].api_key == "flag"
    monkeypatch.setenv("NANOKV_API_KEY", "from-vllm")
    assert settings_of(["m"])[0].api_key == "from-vllm"
    monkeypatch.setenv("NANOKV_API_KEY", "from-nanokv")
    assert settings_of(["m"]) is None
    err = capsys.readouterr().err
    assert "$NANOKV_API_KEY and $VLLM_API_KEY are both set, to different keys" in err
    assert settings_of(["m", "--api-key", "flag"])[0].api_key == "flag"
    monkeypatch.setenv("VLLM_API_KEY", "")
    monkeypatch.delenv("NANOKV_API_KEY")
    assert settings_of(["m"]) is None
    assert "$VLLM_API_KEY: the API key is empty" in capsys.readouterr().err


def test_vllm_flags_without_a_meaning_here_say_so(settings_of, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="nanokv"):
        settings, _ = settings_of(["m", "--disable-log-requests", "--disable-frontend-multiprocessing"])
    assert not settings.log_requests
    assert "--disable-log-requests has no effect" in caplog.text
    assert "--disable-frontend-multiprocessing has no effect" in caplog.text
    assert settings_of(["m", "--api-server-count", "2"]) is None
    assert "nanokv runs one HTTP server process" in capsys.readouterr().err
    for argv, what in ((["--tool-parser-plugin", "p.py"], "tool-parser plugins"),
                       (["--reasoning-parser", "deepseek_r1"], "reasoning parsers"),
                       (["--lora-modules", "a=/x", "b=/y"], "LoRA adapters"), (["--root-path", "/v"], "a root path")):
        assert settings_of(["m", *argv]) is None
        assert f"{argv[0]}: nanokv's server does not support {what}" in capsys.readouterr().err


def test_tool_calling_flags(settings_of, capsys):
    settings, _ = settings_of(["m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    settings, _ = settings_of(["m", "--tool-call-parser", "smollm2"])
    assert not settings.enable_auto_tool_choice and settings.tool_call_parser == "smollm2"
    assert settings_of(["m", "--enable-auto-tool-choice"]) is None
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert settings_of(["m", "--tool-call-parser", "mistral"]) is None
    assert "--tool-call-parser 'mistral' is not available; use one of hermes, smollm2" in capsys.readouterr().err


def test_bad_flag_values_exit_2(capsys):
    for argv, match in ((["--allowed-methods", "[GET"], "not a JSON list"),
                        (["--allowed-headers", "[1]"], "JSON list of strings"),
                        (["--max-log-len", "-1"], "must be >= 0")):
        with pytest.raises(SystemExit):
            main(["serve", "m", *argv])
        assert match in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model", "--response-role", " "]) == 2
    assert "--response-role is empty" in capsys.readouterr().err


# ---- one process: the access log, request logs and VLLM_API_KEY end to end ---------------------

@pytest.mark.slow
def test_a_served_process_with_vllm_flags(model_dir, start_server, tmp_path, monkeypatch):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.2")
    quiet = start_server(model_dir, "--served-model-name", MODEL, "--uvicorn-log-level", "info",
                         "--disable-uvicorn-access-log", "--enable-log-requests", "--max-log-len", "6",
                         "--chat-template", str(template), "--response-role", "bot", "--disable-log-stats")
    client = openai.OpenAI(base_url=quiet.url + "/v1", api_key="vllm-key", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert answer.choices[0].message.role == "bot"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=quiet.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist."):
        client.completions.create(model="other", prompt="Hi", max_tokens=1)
    tokens = httpx.post(quiet.url + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert tokens["count"] == answer.usage.prompt_tokens
    monkeypatch.delenv("VLLM_API_KEY")
    loud = start_server(model_dir, "--served-model-name", MODEL, "--uvicorn-log-level", "info")
    assert httpx.post(loud.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30).is_success
    deadline = time.monotonic() + 60  # the stats line of the interval that saw the request
    while "Avg prompt throughput" not in loud.read_log() and time.monotonic() < deadline:
        time.sleep(0.1)

    quiet.stop()
    loud.stop()
    quiet_log, loud_log = quiet.read_log(), loud.read_log()
    assert '"POST /v1/completions HTTP/1.1" 200' in loud_log and "GET /health" in loud_log
    assert "HTTP/1.1\" " not in quiet_log, quiet_log
    assert "Received request chatcmpl-" in quiet_log and "prompt: '[syste'," in quiet_log
    assert "Received request" not in loud_log
    # the periodic stats line, off with --disable-log-stats (quiet ran longer than loud)
    assert re.search(r"Avg prompt throughput: [1-9][0-9.]* tokens/s, Avg generation throughput: [0-9.]+ tokens/s, "
                     r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [0-9.]+%, Prefix cache hit rate", loud_log)
    assert "Avg prompt throughput" not in quiet_log


@pytest.mark.slow
def test_https_with_ssl_keyfile_and_certfile(model_dir, tmp_path, capsys):
    import shutil
    import ssl
    import subprocess

    from .conftest import Server

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    trust = ssl.create_default_context(cafile=str(cert))

    class TLSServer(Server):
        @property
        def url(self) -> str:
            return f"https://127.0.0.1:{self.port}"

        def _wait_healthy(self, timeout: float) -> bool:
            import time

            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if httpx.get(self.url + "/health", verify=trust, timeout=2).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            return False

    server = TLSServer(model_dir, "--served-model-name", MODEL, "--ssl-keyfile", str(key), "--ssl-certfile",
                       str(cert), log_path=str(tmp_path / "log"))
    try:
        server.start()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60,
                               http_client=httpx.Client(verify=trust))
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port gets no answer
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5).raise_for_status()
    finally:
        server.stop()

    assert main(["serve", "/nonexistent/model", "--ssl-keyfile", str(key)]) == 2
    assert "needs both --ssl-keyfile and --ssl-certfile" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model", "--ssl-keyfile", str(key), "--ssl-certfile", "/no/cert.pem"]) == 2
    assert "--ssl-certfile: '/no/cert.pem' is not a file" in capsys.readouterr().err
