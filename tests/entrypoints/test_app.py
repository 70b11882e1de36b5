"""The server app in process (httpx's ASGI transport, no subprocess): --max-waiting's 503
with Retry-After, /health and requests once the engine is dead, the Bearer check, and
`nanokv serve` without the server extra."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.async_llm import AsyncLLM  # noqa: E402
from nanokv.engine.types import EngineDeadError  # noqa: E402
from nanokv.entrypoints.cli import main  # noqa: E402
from nanokv.entrypoints.openai.api_server import ServerSettings, build_app  # noqa: E402
from nanokv.llm_engine import LLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, max_model_len=256)


def app_for(offline, *, max_num_seqs: int = 8, **settings):
    config = dataclasses.replace(offline.llm_engine.config, max_num_seqs=max_num_seqs)
    llm = AsyncLLM(LLMEngine(config, tokenizer=offline.get_tokenizer()),
                   max_waiting=settings.pop("max_waiting", None))
    return llm, build_app(llm, ServerSettings(model_names=("tiny",), **settings))


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def check_error(resp, status: int, match: str) -> dict:
    assert resp.status_code == status, resp.text[:2000]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert match in error["message"], error["message"]
    return error


def test_max_waiting_answers_503_with_retry_after(offline):
    llm, app = app_for(offline, max_num_seqs=1, max_waiting=1)
    long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)

    async def main():
        llm.start()
        async with client(app) as http:
            running = llm.add([llm.make_request("Hello", long)])
            await running.next_outputs()  # it holds the only seat
            waiting = llm.add([llm.make_request("Hello again", long)])
            full = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            running.close()
            waiting.close()
            for _ in range(200):  # the seat frees within a step
                ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                if ok.status_code != 503:
                    break
                await asyncio.sleep(0.01)
        llm.shutdown()
        return full, ok

    full, ok = run(main())
    check_error(full, 503, "--max-waiting")
    assert full.headers["retry-after"] == "1"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_dead_engine_turns_health_503_and_requests_503(offline):
    llm, app = app_for(offline)

    def dead():
        raise EngineDeadError("rank 1 died (SIGKILL)")

    llm.engine.advance = dead

    async def main():
        llm.start()
        async with client(app) as http:
            healthy = await http.get("/health")
            failed = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            for _ in range(100):
                if not llm.is_alive:
                    break
                await asyncio.sleep(0.01)
            sick = await http.get("/health")
            refused = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            metrics = await http.get("/metrics")
        llm.shutdown()
        return healthy, failed, sick, refused, metrics

    healthy, failed, sick, refused, metrics = run(main())
    assert healthy.status_code == 200
    check_error(failed, 503, "rank 1 died")
    check_error(sick, 503, "rank 1 died")
    check_error(refused, 503, "rank 1 died")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text


def test_api_key_guards_every_v1_route_only(offline):
    llm, app = app_for(offline, api_key="sekrit")

    async def main():
        llm.start()
        async with client(app) as http:
            results = {
                "none": await http.get("/v1/models"),
                "wrong": await http.get("/v1/models", headers={"Authorization": "Bearer nope"}),
                "post": await http.post("/v1/completions", content=b"not json"),
                "unknown": await http.get("/v1/nothing"),
                "right": await http.get("/v1/models", headers={"Authorization": "Bearer sekrit"}),
                "health": await http.get("/health"),
                "metrics": await http.get("/metrics"),
            }
        llm.shutdown()
        return results

    r = run(main())
    for name in ("none", "wrong", "post", "unknown"):
        check_error(r[name], 401, "API key")
        assert r[name].headers["www-authenticate"] == "Bearer"
    assert r["right"].status_code == 200 and r["right"].json()["data"][0]["id"] == "tiny"
    assert r["health"].status_code == 200 and r["metrics"].status_code == 200


def test_unknown_routes_and_methods_get_error_objects(offline):
    llm, app = app_for(offline)

    async def main():
        llm.start()
        async with client(app) as http:
            missing = await http.get("/v1/nothing")
            method = await http.get("/v1/completions")
            model = await http.get("/v1/models/other")
        llm.shutdown()
        return missing, method, model

    missing, method, model = run(main())
    check_error(missing, 404, "/v1/completions")
    check_error(method, 405, "Method Not Allowed")
    check_error(model, 404, "The model `other` does not exist.")


def test_serve_without_its_packages_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "the server needs fastapi" in err and "pip install 'fastapi>=0.110'" in err


def test_a_body_over_the_limit_is_413(offline, monkeypatch):
    from nanokv.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "MAX_BODY_BYTES", 1000)
    llm, app = app_for(offline)

    async def main():
        llm.start()
        async with client(app) as http:
            big = await http.post("/v1/completions", json={"prompt": "x" * 2000})
            small = await http.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 1})
        llm.shutdown()
        return big, small

    big, small = run(main())
    check_error(big, 413, "over 1000 bytes")
    assert small.status_code == 200


def test_serve_flag_errors_exit_2(capsys):
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model"]) == 2
    assert "nanokv serve: error: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "70000"])
    for seconds in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main(["serve", "--timeout-keep-alive", seconds])
        assert "must be a positive number of seconds" in capsys.readouterr().err


def test_max_tokens_past_max_model_len_is_400_and_shorter_ones_are_clamped(offline):
    llm, app = app_for(offline)  # max_model_len 256

    async def main():
        llm.start()
        async with client(app) as http:
            over = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 257})
            huge = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_completion_tokens": 10**30})
            fits = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 256, "ignore_eos": True})
        llm.shutdown()
        return over, huge, fits

    over, huge, fits = run(main())
    assert check_error(over, 400, "max_tokens=257 is more than max_model_len (256)")["param"] == "max_tokens"
    assert check_error(huge, 400, "more than max_model_len")["param"] == "max_completion_tokens"
    assert fits.status_code == 200 and fits.json()["choices"][0]["finish_reason"] == "length"
    assert fits.json()["usage"]["total_tokens"] == 256  # clamped to what the prompt leaves


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(offline, monkeypatch):
    from nanokv.entrypoints.openai import protocol

    llm, app = app_for(offline)  # max_model_len 256; the tiny tokenizer's longest token has 16 characters
    tokenized = []
    make_request, render_chat = llm.engine.make_request, protocol.render_chat
    monkeypatch.setattr(llm.engine, "make_request", lambda prompt, *a, **k: tokenized.append(len(str(prompt)))
                        or make_request(prompt, *a, **k))
    monkeypatch.setattr(protocol, "render_chat", lambda tok, messages, *a: tokenized.append("chat")
                        or render_chat(tok, messages, *a))

    async def main():
        llm.start()
        async with client(app) as http:
            answers = [await http.post("/v1/completions", json={"prompt": "x" * 4097}),
                       await http.post("/v1/completions", json={"prompt": ["Hi", "y" * 10_000_000]}),
                       await http.post("/v1/chat/completions", json={"messages": [
                           {"role": "system", "content": "z" * 3000}, {"role": "user", "content": "w" * 1100}]}),
                       await http.post("/v1/completions", json={"prompt": "word " * 800})]  # 4,000: tokenized
        llm.shutdown()
        return answers

    long, batch, chat, tokenized_long = run(main())
    assert check_error(long, 400, "prompt has 4097 characters: more than max_model_len (256) tokens")["param"] \
        == "prompt"
    check_error(batch, 400, "prompt has 10000000 characters")
    assert check_error(chat, 400, "messages has 4110 characters")["param"] == "messages"
    check_error(tokenized_long, 400, "tokens but max_model_len is 256")
    assert tokenized == [4000]  # only the last one reached the tokenizer


def test_an_empty_api_key_is_refused_at_start(monkeypatch, capsys):
    # checked before the model loads: the model here does not exist, the key is what is named
    for key in ("", "   "):
        assert main(["serve", "/nonexistent/model", "--api-key", key]) == 2
        assert "--api-key: the API key is empty" in capsys.readouterr().err
    monkeypatch.setenv("NANOKV_API_KEY", "")
    assert main(["serve", "/nonexistent/model"]) == 2
    assert "$NANOKV_API_KEY: the API key is empty" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model", "--api-key", " key "]) == 2
    assert "whitespace" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        ServerSettings(model_names=("tiny",), api_key="")


def test_the_bearer_scheme_is_case_insensitive(offline):
    llm, app = app_for(offline, api_key="sekrit")

    async def main():
        llm.start()
        async with client(app) as http:
            codes = {header: (await http.get("/v1/models", headers={"Authorization": header})).status_code
                     for header in ("Bearer sekrit", "bearer sekrit", "BEARER sekrit", "bEaReR  sekrit",
                                    "Basic sekrit", "Bearer sekrit2", "Bearer", "sekrit")}
        llm.shutdown()
        return codes

    assert run(main()) == {"Bearer sekrit": 200, "bearer sekrit": 200, "BEARER sekrit": 200, "bEaReR  sekrit": 200,
                           "Basic sekrit": 401, "Bearer sekrit2": 401, "Bearer": 401, "sekrit": 401}


def test_500_bodies_carry_no_exception_text(offline, caplog):
    llm, app = app_for(offline)
    secret = "/home/someone/secret-path-4711"

    async def broken_snapshot():
        raise RuntimeError(f"cannot read {secret}")

    def broken_step(batch):
        raise RuntimeError(f"kernel failed on {secret}")

    llm.snapshot = broken_snapshot
    llm.engine.executor.execute = broken_step

    async def main():
        llm.start()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            scrape = await http.get("/metrics")
            whole = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            streamed = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
        llm.shutdown()
        return scrape, whole, streamed

    with caplog.at_level("ERROR", logger="nanokv"):
        scrape, whole, streamed = run(main())
    check_error(scrape, 500, "internal server error")
    check_error(whole, 500, "the request failed inside the server")
    event = json.loads(streamed.text.split("\n\n")[0].removeprefix("data: "))
    assert event["error"]["code"] == 500 and "the request failed inside the server" in event["error"]["message"]
    for resp in (scrape, whole, streamed):
        assert secret not in resp.text and "RuntimeError" not in resp.text
    assert secret in caplog.text  # the log keeps it


def test_an_engine_loop_that_dies_leaves_its_exception_text_in_the_log_only(offline, caplog):
    """A bug that stops the engine thread: the 503s (the request, /health) say so without
    the exception's text."""
    llm, app = app_for(offline)
    secret = "/home/someone/secret-path-4712"

    def broken_apply(commands):
        raise RuntimeError(f"cannot apply {secret}")

    llm._apply = broken_apply

    async def main():
        llm.start()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            whole = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            health = await http.get("/health")
        llm.shutdown()
        return whole, health

    with caplog.at_level("ERROR", logger="nanokv"):
        whole, health = run(main())
    check_error(whole, 503, "the engine stopped")
    check_error(health, 503, "the engine is not running")
    for resp in (whole, health):
        assert secret not in resp.text, resp.text
        assert "the server's log" in resp.text
    assert secret in caplog.text  # the log keeps it


def test_host_origin_and_content_type_checks(offline, capsys):
    """In process: the transport's URL is the address a request arrived on (loopback or not)."""
    body = {"prompt": "Hi", "max_tokens": 1}

    async def send(app, base: str, requests: list) -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base) as http:
            return [await http.request(method, path, json=body if method == "POST" else None, headers=headers)
                    for method, path, headers in requests]

    def answers(settings: dict, base: str, requests: list) -> list:
        llm, app = app_for(offline, **settings)

        async def main():
            llm.start()
            try:
                return await send(app, base, requests)
            finally:
                llm.shutdown()

        return run(main())

    hosts = ["evil.example:8000", "EVIL.example", "localhost:8000", "ui.localhost", "[::1]:8000", "10.1.2.3",
             "my.box:8000", "a.my.domain", "my.domain"]
    host_requests = [("GET", "/v1/models", {"Host": h}) for h in hosts]
    codes = lambda resps: [r.status_code for r in resps]  # noqa: E731
    # over loopback: IP addresses and localhost only
    assert codes(answers({}, "http://127.0.0.1:8000", host_requests)) == [403, 403, 200, 200, 200, 200, 403, 403, 403]
    # on a network address: any name, unless --allowed-hosts lists them
    assert codes(answers({}, "http://192.168.1.5:8000", host_requests)) == [200] * 9
    allowed = {"allowed_hosts": ("my.box", ".my.domain")}
    for base in ("http://127.0.0.1:8000", "http://192.168.1.5:8000"):
        assert codes(answers(allowed, base, host_requests)) == [403, 403, 200, 200, 200, 200, 200, 200, 200]
    assert codes(answers({"allowed_hosts": ("*",)}, "http://127.0.0.1:8000", host_requests)) == [200] * 9

    # Origin: refused unless allowed (or the same origin); CORS only for allowed origins
    origin_requests = [("POST", "/v1/completions", {"Origin": "http://ui.example"}),
                       ("GET", "/v1/models", {"Origin": "http://other.example"}),
                       ("POST", "/v1/completions", {"Origin": "http://127.0.0.1:8000"}),
                       ("OPTIONS", "/v1/completions", {"Origin": "http://ui.example", "Access-Control-Request-Method":
                                                       "POST", "Access-Control-Request-Headers": "authorization"})]
    off = answers({}, "http://127.0.0.1:8000", origin_requests)
    assert codes(off) == [403, 403, 200, 403]
    assert not any("access-control-allow-origin" in r.headers for r in off)
    check_error(off[0], 403, "--allowed-origins http://ui.example")
    on = answers({"allowed_origins": ("http://ui.example",)}, "http://127.0.0.1:8000", origin_requests)
    assert codes(on) == [200, 403, 200, 200]
    assert on[0].headers["access-control-allow-origin"] == "http://ui.example"
    assert on[3].headers["access-control-allow-origin"] == "http://ui.example"

    # JSON by its Content-Type only
    llm, app = app_for(offline)

    async def typed():
        llm.start()
        async with client(app) as http:
            out = [await http.post("/v1/completions", content=json.dumps(body).encode(),
                                   headers={} if t is None else {"Content-Type": t})
                   for t in (None, "text/plain", "multipart/form-data; boundary=x", "application/json",
                             "Application/JSON; charset=utf-8", "application/merge-patch+json")]
        llm.shutdown()
        return out

    assert codes(run(typed())) == [415, 415, 415, 200, 200, 200]

    for flag, value, match in (("--allowed-origins", "ui.example", "not an origin"),
                               ("--allowed-origins", "http://ui.example/path", "not an origin"),
                               ("--allowed-hosts", "http://my.box", "not a host name")):
        assert main(["serve", "/nonexistent/model", flag, value]) == 2
        assert match in capsys.readouterr().err


def test_a_non_streamed_response_over_the_size_budget_is_400(offline):
    llm, app = app_for(offline, max_response_tokens=100)  # max_model_len 256
    chat = [{"role": "user", "content": "Hi"}]
    bodies = [  # (path, body, status)
        ("/v1/completions", {"prompt": "Hi", "n": 2, "max_tokens": 50, "ignore_eos": True}, 200),  # 100: fits
        ("/v1/completions", {"prompt": "Hi", "n": 2, "max_tokens": 51}, 400),
        ("/v1/completions", {"prompt": ["Hi", "Ho"], "max_tokens": 51}, 400),  # prompts count too
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "logprobs": 4, "ignore_eos": True}, 200),  # 100
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "logprobs": 5}, 400),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": None}, 400),  # unset: what max_model_len leaves
        ("/v1/chat/completions", {"messages": chat}, 400),
        ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 40, "logprobs": True,
                                  "top_logprobs": 2}, 400),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "max_tokens": 60, "ignore_eos": True, "stream": True}, 200),
    ]

    async def main():
        llm.start()
        async with client(app) as http:
            out = [await http.post(path, json=body) for path, body, _ in bodies]
        llm.shutdown()
        return out

    answers = run(main())
    assert [r.status_code for r in answers] == [status for _, _, status in bodies], [r.text[:200] for r in answers]
    error = check_error(answers[1], 400, "this response could hold 102 tokens and logprobs (n=2 x up to 51 tokens")
    assert "more than the 100 a non-streamed response may hold (--max-response-tokens)" in error["message"]
    assert error["param"] == "max_tokens"
    assert check_error(answers[7], 400, "(1 + logprobs 2)")["param"] == "max_completion_tokens"
    assert answers[0].json()["usage"]["completion_tokens"] == 100
    assert answers[-1].text.count('"finish_reason":"length"') == 2  # streamed: not limited

    # the default: n=1024 with 20 logprobs and max_tokens null is refused before anything runs
    llm, app = app_for(offline)

    async def default():
        llm.start()
        async with client(app) as http:
            resp = await http.post("/v1/completions", json={"prompt": "Hi", "n": 1024, "logprobs": 20,
                                                                "max_tokens": None})
        llm.shutdown()
        return resp

    check_error(run(default()), 400, f"more than the {2**19} a non-streamed response may hold")


def test_the_descriptor_limit_is_raised_and_connections_capped_below_it(capsys):
    import resource
    import subprocess

    from nanokv.entrypoints.openai.connections import FD_RESERVE, connection_limits

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard > 256:  # in a child: a low soft limit is raised to the hard one
        code = ("import resource; from nanokv.entrypoints.openai.connections import raise_fd_limit; "
                "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
                "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == [str(hard), str(hard)], out.stderr
    cap, backlog = connection_limits(None, 1024)
    assert cap + 4 * backlog + FD_RESERVE < 1024 and cap > 512  # an accept burst never reaches the limit
    assert connection_limits(100, 1024) == (100, backlog)
    with pytest.raises(ValueError, match="--max-connections 5000 needs more file descriptors"):
        connection_limits(5000, 1024)
    with pytest.raises(ValueError, match="raise it"):
        connection_limits(None, 150)
    for seconds in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            main(["serve", "--timeout-request-read", seconds])
        assert "must be a positive number of seconds" in capsys.readouterr().err
