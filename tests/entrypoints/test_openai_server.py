"""`nanokv serve` in a subprocess, driven by the official openai client (sync and async)
and raw HTTP: answers equal LLM.generate / LLM.chat on the same model; streamed text
equals the whole text; usage counts the tokens; 32 concurrent streams equal sequential
runs; every bad request is a 400 with OpenAI's error object and touches nothing; a client
that disconnects or is killed mid-stream leaves no running request and no used KV block;
/metrics parses and adds up."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from nanokv import LLM, SamplingParams  # noqa: E402

from .conftest import API_KEY, metrics, serve, server_env, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_LEN = 256
PROMPTS = ["Hello there", "The capital of France is", "def f(x):", "Once upon a time, in a land far away",
           "Simple is better than complex."]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve(model_dir, "--served-model-name", MODEL, "tiny-alias", "--api-key", API_KEY,
               "--max-model-len", str(MAX_LEN), log_path=str(tmp_path_factory.mktemp("server") / "log"))


# The abort tests need a request that cannot finish before its client goes away: on the tiny
# model 4 x 240 tokens take 0.1 s, less than a busy machine may take to kill a client
# (a killed client's request then ran to its end and counted as finished). A 16k context
# and no max_tokens make it minutes of work, so "nothing running" within the idle wait's
# seconds is the abort's doing.
LONG_LEN = 16384


@pytest.fixture(scope="module")
def long_server(checkpoint, tmp_path_factory):
    yield from serve(checkpoint("qwen3-tiny", max_position_embeddings=LONG_LEN), "--served-model-name", MODEL,
               "--api-key", API_KEY, "--max-model-len", str(LONG_LEN), "--kv-cache-memory-bytes", str(128 << 20),
               log_path=str(tmp_path_factory.mktemp("long-server") / "log"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, max_model_len=MAX_LEN)


def post(server, path: str, body=None, *, content: bytes | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, content=content, timeout=timeout,
                      headers={**AUTH, "Content-Type": "application/json"})


def texts(choices) -> list[str]:
    return [c.text if hasattr(c, "text") else c.message.content for c in sorted(choices, key=lambda c: c.index)]


def concat_stream(chunks, chat: bool) -> tuple[dict, dict, object]:
    """index -> text, index -> finish_reason, and the usage chunk's usage."""
    text, reasons, usage = {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            text[c.index] = text.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return text, reasons, usage


SAMPLINGS = [dict(temperature=0, max_tokens=12),
             dict(temperature=0.9, top_p=0.9, seed=7, max_tokens=12),
             dict(temperature=1.0, seed=3, n=3, max_tokens=10, presence_penalty=0.5, frequency_penalty=0.3)]


def test_token_constraints_equal_offline(client, offline):
    """logit_bias (OpenAI's string keys), allowed_token_ids and bad_words (vLLM's extras,
    through extra_body) on both endpoints: the tokens LLM.generate / LLM.chat give."""
    prompt = PROMPTS[1]
    cases = [dict(logit_bias={"77": 100}), dict(logit_bias={"5": -100, "300": 4.5}),
             dict(extra_body={"allowed_token_ids": [11, 200, 301, 999]}), dict(extra_body={"bad_words": ["the", " a"]}),
             dict(extra_body={"allowed_token_ids": [11, 200, 301], "bad_words": ["x"]}, logit_bias={"200": -100})]
    for kw in cases:
        extra = dict(kw.get("extra_body", {}))
        fields = {**extra, **({"logit_bias": kw["logit_bias"]} if "logit_bias" in kw else {})}
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **fields)
        ref = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10,
                                        logit_bias=kw.get("logit_bias"),
                                        extra_body={**extra, "ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].token_ids == list(ref.token_ids), kw
        chat_ref = offline.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=10,
                                              logit_bias=kw.get("logit_bias"), extra_body={**extra, "ignore_eos": True})
        assert chat.choices[0].message.content == chat_ref.text, kw
    assert set(ref.token_ids) <= {11, 301}


@pytest.mark.parametrize("kw", SAMPLINGS)
def test_completions_equal_offline_and_the_stream_equals_the_whole(client, offline, kw):
    prompt = PROMPTS[3]
    ref = offline.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, **kw)
    assert whole.object == "text_completion" and whole.model == MODEL and whole.id.startswith("cmpl-")
    assert texts(whole.choices) == [c.text for c in ref.outputs]
    assert [c.finish_reason for c in sorted(whole.choices, key=lambda c: c.index)] == \
        [c.finish_reason for c in ref.outputs]
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text, reasons, usage = concat_stream(chunks, chat=False)
    assert [text[i] for i in range(len(ref.outputs))] == texts(whole.choices)
    assert [reasons[i] for i in range(len(ref.outputs))] == [c.finish_reason for c in ref.outputs]
    assert usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])  # include_usage: null on the others


@pytest.mark.parametrize("kw", SAMPLINGS)
def test_chat_equals_offline_and_the_stream_equals_the_whole(client, offline, kw):
    ref = offline.chat(CHAT, SamplingParams(**kw), use_tqdm=False)[0]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert all(c.message.role == "assistant" for c in whole.choices)
    assert texts(whole.choices) == [c.text for c in ref.outputs]
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    n = kw.get("n", 1)
    first = chunks[:n]  # the role first, once per choice
    assert sorted(c.choices[0].index for c in first) == list(range(n))
    assert all(c.choices[0].delta.role == "assistant" and c.object == "chat.completion.chunk" for c in first)
    text, reasons, usage = concat_stream(chunks, chat=True)
    assert [text[i] for i in range(n)] == texts(whole.choices)
    assert [reasons[i] for i in range(n)] == [c.finish_reason for c in ref.outputs]
    assert usage.model_dump() == whole.usage.model_dump()


def test_chat_content_parts_and_the_model_alias(client):
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    split = client.chat.completions.create(model="tiny-alias", messages=parts, temperature=0, max_completion_tokens=8)
    assert texts(split.choices) == texts(plain.choices) and split.model == "tiny-alias"
    two = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "a KV cache?"}]}]
    joined = [{"role": "user", "content": "What is\na KV cache?"}]
    assert texts(client.chat.completions.create(model=MODEL, messages=two, temperature=0, max_tokens=8).choices) == \
        texts(client.chat.completions.create(model=MODEL, messages=joined, temperature=0, max_tokens=8).choices)


def test_a_big_body_is_answered_like_a_small_one(server, client):
    small = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    big = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                    user="u" * 100_000)  # parsed and tokenized in a worker thread
    assert texts(big.choices) == texts(small.choices)


def test_prompt_forms_choice_indices_and_usage(client, offline):
    tok = offline.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS[:2]]
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6)
    ref = offline.generate(PROMPTS[:2], params, use_tqdm=False)
    expected = [c.text for r in ref for c in r.outputs]  # prompt index * n + sample index
    usage = (sum(len(r.prompt_token_ids) for r in ref), sum(len(c.token_ids) for r in ref for c in r.outputs))
    for prompt in (PROMPTS[:2], ids):
        resp = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=5, n=2, max_tokens=6)
        assert texts(resp.choices) == expected
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == usage
    single = client.completions.create(model=MODEL, prompt=ids[0], temperature=0, max_tokens=6)
    assert texts(single.choices) == [offline.generate([ids[0]], SamplingParams(temperature=0, max_tokens=6),
                                                      use_tqdm=False)[0].outputs[0].text]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[:2], temperature=1.0, seed=5, n=2,
                                            max_tokens=6, stream=True))
    assert [concat_stream(chunks, chat=False)[0][i] for i in range(4)] == expected


def test_sampling_extras_and_finish_reasons_equal_offline(client, offline):
    prompt = PROMPTS[0]
    greedy = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    stop_token = greedy.token_ids[4]
    stop_text = greedy.text[6:9]
    cases = [dict(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=5),
             dict(temperature=0, max_tokens=20, stop=[stop_text]),
             dict(temperature=0, max_tokens=20, stop=stop_text, include_stop_str_in_output=True),
             dict(temperature=0, max_tokens=20, stop_token_ids=[stop_token]),
             dict(temperature=0.8, seed=9, max_tokens=12, top_k=5, min_p=0.05, repetition_penalty=1.3),
             dict(temperature=0, max_tokens=None)]  # up to max_model_len
    extras = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
              "include_stop_str_in_output"}
    for kw in cases:
        ref = offline.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
        body = {k: v for k, v in kw.items() if k not in extras}
        resp = client.completions.create(model=MODEL, prompt=prompt, extra_body={k: v for k, v in kw.items()
                                                                                 if k in extras}, **body)
        choice = resp.choices[0]
        assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason), kw
        assert choice.model_extra["stop_reason"] == ref.stop_reason, kw
        assert resp.usage.completion_tokens == len(ref.token_ids), kw


def test_logprobs_equal_offline(client, offline):
    prompt = PROMPTS[1]
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3),
                           use_tqdm=False)[0].outputs[0]
    tok = offline.get_tokenizer()
    resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    for top, entry in zip(lp.top_logprobs, ref.logprobs):  # top 3 + the sampled token, keyed by text
        assert 3 <= len(entry) <= 4 and set(top) == {tok.decode([t], skip_special_tokens=False) for t in entry}
        assert max(top.values()) == pytest.approx(max(v.logprob for v in entry.values()), abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=3,
                                            stream=True))
    streamed = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    offsets = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.text_offset]
    assert streamed == lp.token_logprobs and offsets == lp.text_offset

    chat_ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat_ref.outputs[0].token_ids) == chat.usage.completion_tokens
    for item, t, entry in zip(content, chat_ref.outputs[0].token_ids, chat_ref.outputs[0].logprobs):
        assert item.token == tok.decode([t], skip_special_tokens=False)
        assert item.bytes == list(item.token.encode()) and item.logprob == pytest.approx(entry[t].logprob, abs=1e-5)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6)
    assert plain.choices[0].logprobs is None


def test_32_concurrent_streams_equal_sequential_runs(server, client):
    def request(i: int) -> dict:
        kw = dict(max_tokens=16 + i % 5, temperature=0) if i % 2 else dict(max_tokens=16, temperature=1.0, seed=i)
        if i % 4 < 2:
            return dict(kind="completions", prompt=PROMPTS[i % len(PROMPTS)], **kw)
        return dict(kind="chat", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], **kw)

    requests = [request(i) for i in range(32)]

    def sequential(r: dict) -> str:
        r = dict(r)
        if r.pop("kind") == "chat":
            return client.chat.completions.create(model=MODEL, **r).choices[0].message.content
        return client.completions.create(model=MODEL, **r).choices[0].text

    expected = [sequential(r) for r in requests]

    async def concurrent() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)

        async def one(r: dict) -> str:
            r = dict(r)
            chat = r.pop("kind") == "chat"
            create = aclient.chat.completions.create if chat else aclient.completions.create
            stream = await create(model=MODEL, stream=True, **r)
            parts = []
            async for chunk in stream:
                for c in chunk.choices:
                    parts.append((c.delta.content or "") if chat else c.text)
            return "".join(parts)

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), 120)
        finally:
            await aclient.close()

    assert asyncio.run(concurrent()) == expected
    assert_idle(server)


def assert_idle(server, timeout: float = 10) -> dict:
    """Within `timeout`: nothing running or waiting, no KV block in use."""
    return wait_idle(server.url, timeout)


def successes(m: dict) -> float:
    """Samples run to the end (stop, length, error), not aborted ones."""
    return sum(v for k, v in m.items() if k.startswith("vllm:request_success_total") and "=abort" not in k)


LONG = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": None, "ignore_eos": True, "temperature": 0, "n": 4}


def test_a_client_that_disconnects_mid_stream_aborts_its_request(long_server):
    server = long_server
    start = assert_idle(server)
    before = successes(start)
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in got)
    after = assert_idle(server)
    assert successes(after) == before  # aborted, not run to the end
    aborted = "vllm:request_success_total{finished_reason=abort}"
    assert after[aborted] - start[aborted] == LONG["n"]  # each sample ends as "abort"


def test_a_non_streaming_client_that_goes_away_aborts_its_request(long_server):
    server = long_server
    before = successes(assert_idle(server))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=httpx.Timeout(30, read=0.1))
    after = assert_idle(server)
    assert successes(after) == before


def test_a_client_that_hangs_up_mid_body_gets_no_traceback_and_the_server_keeps_serving(server, client):
    """Headers promising a body, half of it, then the socket closed: the server answers
    nobody (the read ends in a 400 for its log, not a 500 with a traceback) and serves the
    next request."""
    import socket
    from urllib.parse import urlsplit

    before = successes(assert_idle(server))
    address = urlsplit(server.url)
    body = json.dumps({**LONG, "stream": True}).encode()
    for _ in range(3):
        with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:len(body) // 2])
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert out.choices[0].text is not None
    assert successes(assert_idle(server)) == before + 1
    assert "Traceback" not in server.read_log()


KILLED_CLIENT = """
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=30)
stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                        temperature=0, n=4, extra_body={"ignore_eos": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print("streaming", flush=True)
        sys.stdin.read()  # wait to be killed
"""


def test_a_client_killed_mid_stream_leaves_nothing_running(long_server):
    server = long_server
    before = successes(assert_idle(server))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url + "/v1", API_KEY], env=server_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"streaming\n", proc.stderr.read()
        import time; time.sleep(1)  # a busy machine
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    after = assert_idle(server)
    assert successes(after) == before


def test_metrics_parse_and_add_up(server, client):
    before = assert_idle(server)
    usages = []
    shared = " ".join(PROMPTS) * 2  # over two KV blocks: the second request hits the prefix cache
    for _ in range(2):
        usages.append(client.completions.create(model=MODEL, prompt=shared, max_tokens=5, temperature=0).usage)
    usages.append(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, temperature=0).usage)
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=9, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage:
            usages.append(chunk.usage)
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage:
            usages.append(chunk.usage)
    after = assert_idle(server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert len(usages) == 5
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    assert delta("vllm:request_success_total{finished_reason=stop}") + \
        delta("vllm:request_success_total{finished_reason=length}") == 5
    assert delta("vllm:request_success_total{finished_reason=error}") == 0
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == completion
    assert delta("vllm:prefix_cache_queries_total") == prompt  # one lookup per admission, no preemption
    assert delta("vllm:prefix_cache_hits_total") >= 16
    assert delta("vllm:e2e_request_latency_seconds_count") == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 5  # streamed or not
    streamed = usages[3:]  # inter-token times come from streamed requests
    assert delta("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens for u in streamed) - 2
    assert delta("vllm:num_preemptions_total") == 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        buckets = sorted((float(k.split("le=")[1].rstrip("}")), v) for k, v in after.items()
                         if k.startswith(f"vllm:{name}_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert buckets[-1][1] == after[f"vllm:{name}_count"]


def test_health_models_and_the_api_key(server, client):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # no key needed
    assert [m.id for m in client.models.list().data] == [MODEL, "tiny-alias"]
    assert client.models.retrieve(MODEL).id == MODEL
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert resp.status_code == 401 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True)


def test_cross_site_requests_are_refused(server):
    """A page on another site: its text/plain POST (no preflight needed), its requests
    after DNS rebinding (Host: its own name), its Origin; none is served, none gets CORS
    headers. The openai client and plain scripts (JSON, an IP or localhost, no Origin) are."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    port = server.port

    def send(method: str, path: str, headers: dict, content: bytes | None = None) -> httpx.Response:
        return httpx.request(method, server.url + path, content=content, headers={**AUTH, **headers}, timeout=30)

    plain = send("POST", "/v1/completions", {"Content-Type": "text/plain"}, body)
    typeless = send("POST", "/v1/completions", {}, body)
    form = send("POST", "/v1/completions", {"Content-Type": "application/x-www-form-urlencoded"}, body)
    for resp in (plain, typeless, form):
        assert resp.status_code == 415 and resp.json()["error"]["type"] == "UnsupportedMediaTypeError", resp.text
        assert "Content-Type: application/json" in resp.json()["error"]["message"]
    foreign = send("POST", "/v1/completions", {"Content-Type": "text/plain", "Origin": "http://evil.example"}, body)
    rebound = send("GET", "/v1/models", {"Host": f"evil.example:{port}"})
    rebound_post = send("POST", "/v1/completions", {"Host": f"evil.example:{port}",
                                                    "Content-Type": "application/json"}, body)
    preflight = send("OPTIONS", "/v1/completions", {"Origin": "http://evil.example",
                                                    "Access-Control-Request-Method": "POST"})
    for resp in (foreign, rebound, rebound_post, preflight):
        assert resp.status_code == 403 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert "access-control-allow-origin" not in resp.headers
        assert server.model not in resp.text
    assert "--allowed-hosts evil.example" in rebound.json()["error"]["message"]
    assert "--allowed-origins http://evil.example" in foreign.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"LOCALHOST.:{port}"):
        ok = send("POST", "/v1/completions", {"Host": host, "Content-Type": "application/json; charset=utf-8"}, body)
        assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers, (host, ok.text)


TOO_LONG = "word " * 400
BAD = [  # (path, body or raw bytes, param, part of the message)
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", b"", None, "empty"),
    ("/v1/completions", b"[1, 2]", None, "JSON object"),
    ("/v1/chat/completions", b'"hello"', None, "JSON object"),
    ("/v1/completions", b"\xff\xfe{}", None, "not valid JSON"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", None, "levels deep"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 20000}, "prompt", "max_model_len"),  # off the loop
    ("/v1/chat/completions", {"model": 5, "messages": CHAT}, "model", "model must be a string"),
    ("/v1/completions", {"model": MODEL}, "prompt", "prompt is required"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt", "prompt must be"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", 1]}, "prompt", "not a mix"),
    ("/v1/completions", {"model": MODEL, "prompt": {"text": "x"}}, "prompt", "prompt must be"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt", "prompt is empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}, "prompt", "prompt is empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**7]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, True]}, "prompt", "not a mix"),
    ("/v1/completions", {"model": MODEL, "prompt": [[5, 2.5]]}, "prompt", "must be ints"),
    ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG}, "prompt", "max_model_len"),
    ("/v1/completions", {"model": MODEL, "prompt": ["ok", TOO_LONG]}, "prompt", "prompt 1: prompt has"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}]}, "messages",
     "max_model_len"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", "finite number"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature", ">= 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 10**6}, "top_k", "vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 2}, "min_p", "[0, 1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, "n", "n must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 10**9}, "n", "n must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": "2"}, "n", "n must be an int"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens", ">= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, "max_tokens", "must be an int"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": -5},
     "max_completion_tokens", "max_completion_tokens must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens", "exceed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": "abc"}, "seed", "seed must be an int"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}, "stop", "stop must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 5}, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", b'{"prompt": "x", "frequency_penalty": NaN}', "frequency_penalty", "finite number"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "[0.01, 100"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 1e-40}, "repetition_penalty",
     "[0.01, 100"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["s"] * 257}, "stop", "at most 256"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "s" * 257}, "stop", "at most 256"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 32, "min_tokens": 4,
                         "stop_token_ids": [5] * 1_000_000}, "stop_token_ids", "at most 1024"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 1000}, "logprobs", "allowed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs", "must be an int"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 50},
     "top_logprobs", "top_logprobs=50"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, "top_logprobs",
     "needs logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": 3}, "logprobs", "true or false"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "only allowed with stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "include_usage", "true or false"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logit_bias": {"tok": 1}}, "logit_bias",
     "must be token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias",
     "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "allowed_token_ids": [3, 10**6]},
     "allowed_token_ids", "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "bad_words": [""]}, "bad_words", "non-empty string"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "bad_words": "x" * 300}, "bad_words",
     "at most 256"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "cache_salt": "a"},
     "cache_salt", "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 1000},
     "prompt_logprobs", "prompt_logprobs=1000 is more than"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs", "must be an int"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": "yes"}, "echo", "true or false"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of", "not supported"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools",
     "tools[0].function is missing"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "response_format": {"type": "xml"}},
     "response_format", "json_schema"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "messages is required"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", "non-empty list"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages", "non-empty list"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, "messages", "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages", "no content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages",
     "string or a list"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages", "text only"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [["user", "hi"]]}, "messages", "must be an object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages",
     "lone surrogate"),
    ("/v1/completions", b'{"prompt": "ab\\udfff"}', "prompt", "lone surrogate"),
]


@pytest.mark.parametrize("path, body, param, match", BAD, ids=[f"{i}-{c[3][:20]}" for i, c in enumerate(BAD)])
def test_bad_requests_are_400_and_touch_nothing(server, path, body, param, match):
    before = metrics(server.url)
    resp = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param), error
    assert match in error["message"], error["message"]
    after = metrics(server.url)
    for name in ("vllm:prefix_cache_queries_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "nanokv:kv_cache_used_blocks"):
        assert after[name] == before[name], name


def test_the_openai_client_raises_bad_request_for_400s(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1, stream=True)
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model=MODEL, messages=[])


def test_fuzzed_requests_never_break_the_server(server):
    rng = random.Random(1234)
    values = [None, True, False, 0, 1, -1, 2, 3.5, -2.5, 10**12, -(10**12), 2**64, "", "x", "stop", [], [1],
              [[1, 2]], ["a", "b"], {}, {"a": 1}, [None], float("inf")]
    fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
              "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream",
              "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
              "stop_token_ids", "echo", "best_of", "logit_bias", "user", "tools", "response_format",
              "allowed_token_ids", "bad_words", "structured_outputs", "guided_choice", "guided_regex"]
    statuses = {}
    for i in range(150):
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        body = {"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        for name in rng.sample(fields, rng.randint(1, 4)):
            body[name] = rng.choice(values)
            if name == "messages" and rng.random() < 0.5:
                body[name] = [{"role": rng.choice(values), "content": rng.choice(values)}]
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = 8  # keep valid requests short
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = 4
        content = json.dumps(body).encode() if rng.random() < 0.95 else json.dumps(body).encode()[:rng.randint(0, 40)]
        resp = post(server, path, content=content, timeout=60)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        # a model name nobody serves is vLLM's 404, the rest a 400
        unknown_model = isinstance(body.get("model"), str) and body["model"] != MODEL
        assert resp.status_code in ((200, 400, 404) if unknown_model else (200, 400)), (body, resp.text)
        if resp.status_code in (400, 404):
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert statuses.get(200) and statuses.get(400), statuses
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert_idle(server)
    m = metrics(server.url)
    assert m["vllm:request_success_total{finished_reason=error}"] == 0
