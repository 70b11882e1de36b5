"""`nanokv serve` under load and faults (loopback, the tiny model, bounded in count and time):
200 streams from 64 clients with a quarter cancelled mid-stream equal a sequential run and
leave no KV block in use; 50 malformed or adversarial bodies are each a 4xx with OpenAI's
error object while a good stream finishes; --max-waiting turns a burst's excess into 503s
with Retry-After; SIGTERM during 16 streams ends each with its answer or an error event,
exits 0 within the shutdown timeout and leaves no tensor-parallel worker behind."""

from __future__ import annotations

import asyncio
import json
import os
import random
import selectors
import signal
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from .conftest import Server, metrics, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow

MAX_LEN = 256
WORDS = ("the cache holds keys and values of every token so that a step reads them instead of "
         "recomputing attention over the whole prompt again").split()


def make_specs(count: int, seed: int) -> list[dict]:
    """Distinct requests: completions and chat, greedy and seeded sampling, n 1 or 2."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        kw = dict(max_tokens=rng.randint(6, 40), temperature=0)
        if i % 3 == 1:
            kw.update(temperature=0.9, top_p=0.95, seed=rng.randrange(1000))
        if i % 7 == 3:
            kw["n"] = 2
        if i % 2:
            specs.append(dict(kind="chat", messages=[{"role": "user", "content": text}], **kw))
        else:
            specs.append(dict(kind="completions", prompt=text, **kw))
    return specs


def create(client, spec: dict, **extra):
    """client.<kind>.create(spec) for a sync or async openai client."""
    spec = dict(spec)
    kind = spec.pop("kind")
    api = client.chat.completions if kind == "chat" else client.completions
    return api.create(model="tiny", **spec, **extra)


def choice_texts(resp_or_chunks, chat: bool, streamed: bool) -> tuple[dict, dict]:
    """index -> text and index -> finish_reason, whole or streamed."""
    text, reasons = {}, {}
    items = resp_or_chunks if streamed else [resp_or_chunks]
    for item in items:
        for c in item.choices:
            piece = ((c.delta.content or "") if streamed else c.message.content) if chat else c.text
            text[c.index] = text.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in reasons, "a second finish_reason for one choice"
                reasons[c.index] = c.finish_reason
    return text, reasons


def sequential(url: str, specs: list[dict]) -> list[tuple[dict, dict, int]]:
    """(texts, finish reasons, completion tokens) of each spec, one request at a time."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    results = []
    for spec in specs:
        resp = create(client, spec)
        results.append((*choice_texts(resp, spec["kind"] == "chat", False), resp.usage.completion_tokens))
    return results


def start(model_dir: str, tmp_path, *args: str) -> Server:
    return Server(model_dir, "--served-model-name", "tiny", "--max-model-len", str(MAX_LEN), *args,
                  log_path=str(tmp_path / "server.log")).start()


def successes(m: dict, reason: str | None = None) -> float:
    """Samples run to the end (by reason: stop, length, error; all three by default)."""
    return sum(v for k, v in m.items() if k.startswith("vllm:request_success_total") and "=abort" not in k
               and (reason is None or k.endswith(f"={reason}}}")))


# ---- 200 streams, 64 clients, a quarter cancelled ----------------------------------------------

def test_200_streams_from_64_clients_with_a_quarter_cancelled(model_dir, tmp_path):
    # a small KV pool and step budget: preemption, chunked prefill and shared prefixes under the cancellations
    server = start(model_dir, tmp_path, "--num-kvcache-blocks", "48", "--kvcache-block-size", "8",
                   "--max-num-batched-tokens", "32")
    try:
        specs = make_specs(40, seed=7)
        expected = sequential(server.url, specs)
        rng = random.Random(11)
        jobs = [(i, rng.randrange(len(specs))) for i in range(200)]
        cancelled = set(rng.sample(range(200), 50))
        # a cancelled stream is left after k content chunks, or its task is cancelled after a delay
        # (before or after its first byte)
        plans = {i: ("chunks", rng.randint(0, 4)) if i % 2 else ("timer", rng.uniform(0, 0.4)) for i in cancelled}
        before = metrics(server.url)
        outcomes = asyncio.run(asyncio.wait_for(_load(server.url, specs, jobs, plans), 240))

        ids = [o["id"] for o in outcomes.values() if o.get("id")]
        assert len(ids) == len(set(ids)), "two responses share an id"
        completed = [i for i in range(200) if i not in cancelled]
        assert sorted(outcomes) == list(range(200))  # every request was sent once
        # every request asks for 6 tokens or more: those left after 1-5 chunks are cut mid-stream (unless
        # EOS came first); a timer may fire after the end
        by_chunks = [i for i in cancelled if plans[i][0] == "chunks"]
        assert sum(not outcomes[i]["done"] for i in by_chunks) >= 0.8 * len(by_chunks)
        for i in completed:
            o, (texts, reasons, tokens) = outcomes[i], expected[jobs[i][1]]
            assert o["done"], (i, o)
            assert (o["texts"], o["reasons"], o["usage"]) == (texts, reasons, tokens), (i, specs[jobs[i][1]])
        after = wait_idle(server.url, 30)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        n_samples = sum(specs[jobs[i][1]].get("n", 1) for i in completed)
        finished = successes(after) - successes(before)
        assert n_samples <= finished <= n_samples + 2 * len(cancelled)  # a cancelled one may have finished first
        assert successes(after, "error") == successes(before, "error")
        assert after["vllm:num_preemptions_total"] > 0 and after["vllm:prefix_cache_hits_total"] > 0
    finally:
        server.stop()
    assert "Traceback" not in server.read_log()


async def _load(url: str, specs: list[dict], jobs: list[tuple[int, int]], plans: dict) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))
    gate = asyncio.Semaphore(64)  # 64 clients
    outcomes: dict[int, dict] = {}

    async def one(i: int, spec: dict) -> None:
        chat = spec["kind"] == "chat"
        outcome = outcomes[i] = dict(done=False, id=None, chunks=[])
        plan = plans.get(i)
        stream = await create(client, spec, stream=True, stream_options={"include_usage": True})
        try:
            content = 0
            async for chunk in stream:
                outcome["chunks"].append(chunk)
                assert outcome["id"] in (None, chunk.id)
                outcome["id"] = chunk.id
                content += any((c.delta.content if chat else c.text) for c in chunk.choices)
                if plan and plan[0] == "chunks" and content > plan[1]:
                    return  # leaving the stream closes the connection
            outcome["done"] = True
        finally:
            await stream.close()

    async def guarded(i: int, spec: dict) -> None:
        async with gate:
            task = asyncio.ensure_future(one(i, spec))
            plan = plans.get(i)
            if plan and plan[0] == "timer":
                await asyncio.wait({task}, timeout=plan[1])
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not (plan and plan[0] == "timer"):
                    raise

    try:
        await asyncio.gather(*(guarded(i, specs[s]) for i, s in jobs))
    finally:
        await client.close()
    for i, o in outcomes.items():
        if o["done"]:
            chat = specs[jobs[i][1]]["kind"] == "chat"
            usage = [c.usage for c in o["chunks"] if c.usage is not None]
            assert len(usage) == 1 and o["chunks"][-1].usage is not None, i
            o["texts"], o["reasons"] = choice_texts(o["chunks"], chat, True)
            o["usage"] = usage[0].completion_tokens
    return outcomes


# ---- malformed and adversarial bodies ------------------------------------------------------------

CHAT = [{"role": "user", "content": "Hi"}]


def bad_bodies() -> list[tuple[str, object]]:
    """(path, a JSON body or raw bytes): 50 requests that must each be a 4xx."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok_c, ok_ch = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}, {"model": "tiny", "messages": CHAT}
    wrong_types = [("prompt", 5), ("prompt", {"text": "x"}), ("max_tokens", "10"), ("max_tokens", 2.5),
                   ("temperature", "hot"), ("top_p", [1]), ("n", "2"), ("n", 1.5), ("stop", 5), ("seed", "x"),
                   ("stream", "yes"), ("logprobs", True), ("top_k", 2.5), ("ignore_eos", "no"),
                   ("stop_token_ids", "5"), ("model", 5), ("stream_options", "on")]
    huge = [("n", 10**9), ("n", 2**64), ("max_tokens", 10**9), ("max_tokens", 2**63), ("max_tokens", 10**100),
            ("logprobs", 10**6), ("top_k", 10**12), ("seed", 2**200), ("min_tokens", 10**9)]
    negative = [("max_tokens", -1), ("n", -1), ("temperature", -0.5), ("top_p", -1), ("min_p", -0.1),
                ("top_k", -5), ("min_tokens", -1), ("logprobs", -1), ("presence_penalty", -3),
                ("frequency_penalty", -2.5), ("repetition_penalty", -1)]
    bodies = [(c, {**ok_c, k: v}) for k, v in wrong_types + huge + negative]
    bodies += [
        (ch, {**ok_ch, "max_completion_tokens": 10**12}),
        (ch, {**ok_ch, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        (ch, {**ok_ch, "messages": [{"role": 7, "content": "x"}]}),
        (c, b"[" * 200_000 + b"]" * 200_000),  # deeper than the parser's recursion limit
        (c, b'{"prompt": "Hi", "x": ' + b'{"a": ' * 60 + b"1" + b"}" * 60 + b"}"),  # deep in an unknown field
        (ch, {**ok_ch, "messages": [{"role": "user", "content": "x " * 5_000_000}]}),  # 10 MB
        (c, {**ok_c, "prompt": "y" * 10_000_000}),  # 10 MB
        (c, b'{"prompt": "' + b"z" * (33 * 2**20) + b'"}'),  # over the 32 MiB body limit: 413
        (c, b'{"prompt": "\xff\xfe\xfd"}'),  # invalid UTF-8
        (ch, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'),
        (c, b'{"prompt": "Hi", "max_tokens": 4'),  # truncated
        (c, {**ok_c, "prompt": [1, -5, 3]}),
        (c, {**ok_c, "prompt": [[1, 2], [2**70]]}),
    ]
    return bodies


def test_50_bad_bodies_are_4xx_while_a_good_stream_finishes(model_dir, tmp_path):
    server = start(model_dir, tmp_path)
    try:
        good = dict(kind="completions", prompt="Once upon a time", max_tokens=200, temperature=0, n=4)
        (texts, reasons, tokens), = sequential(server.url, [{**good, "extra_body": {"ignore_eos": True}}])
        bodies = bad_bodies()
        assert len(bodies) == 50
        streamed, statuses = asyncio.run(asyncio.wait_for(_good_and_bad(server.url, good, bodies), 240))
        assert choice_texts(streamed, False, True) == (texts, reasons)
        assert streamed[-1].usage.completion_tokens == tokens
        wrong = []
        for (path, body), (status, error) in zip(bodies, statuses):
            if not (400 <= status < 500 and set(error) == {"message", "type", "param", "code"}
                    and error["code"] == status):
                shown = body[:80] if isinstance(body, bytes) else {k: str(v)[:40] for k, v in body.items()}
                wrong.append((status, shown, error))
        assert not wrong
        assert sum(s == 413 for s, _ in statuses) == 1
        # unknown fields are ignored (as vLLM does), whatever they hold
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
        odd = {"x_unknown": {"a": [[[[1]]]]}, "metadata_blob": "m" * 100_000, "nothing": None, "zz": [1.5, "x"]}
        plain = create(client, dict(kind="completions", prompt="Hi", max_tokens=6, temperature=0))
        extra = create(client, dict(kind="completions", prompt="Hi", max_tokens=6, temperature=0), extra_body=odd)
        assert extra.choices[0].text == plain.choices[0].text
        wait_idle(server.url, 30)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
    assert "Traceback" not in server.read_log()


async def _good_and_bad(url: str, good: dict, bodies: list) -> tuple[list, list]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
    first = asyncio.Event()

    async def stream_good() -> list:
        chunks = []
        stream = await create(client, good, stream=True, stream_options={"include_usage": True},
                              extra_body={"ignore_eos": True})
        async for chunk in stream:
            chunks.append(chunk)
            first.set()
        return chunks

    async def send(http, path: str, body) -> tuple[int, dict]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = await http.post(url + path, content=content, headers={"Content-Type": "application/json"})
        try:
            return resp.status_code, resp.json().get("error") or {}
        except ValueError:
            return resp.status_code, {"unparsed": resp.text[:200]}

    async def send_all() -> list:
        await first.wait()  # the good stream is under way
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as http:
            async def guarded(path, body):
                async with gate:
                    return await send(http, path, body)
            return await asyncio.gather(*(guarded(p, b) for p, b in bodies))

    try:
        good_task = asyncio.ensure_future(stream_good())
        statuses = await send_all()
        return await good_task, statuses
    finally:
        await client.close()


# ---- the queue bound ----------------------------------------------------------------------------

def test_a_burst_past_max_waiting_gets_503_with_retry_after(model_dir, tmp_path):
    server = start(model_dir, tmp_path, "--max-waiting", "4", "--max-num-seqs", "2")
    try:
        specs = [dict(kind="completions", prompt=" ".join(WORDS[i:i + 5]), max_tokens=96, temperature=0,
                      extra_body={"ignore_eos": True}) for i in range(8)]  # long enough to outlast the burst
        expected = sequential(server.url, specs)
        results = asyncio.run(asyncio.wait_for(_burst(server.url, specs, 64), 240))
        ok = [r for r in results if r[0] == 200]
        full = [r for r in results if r[0] == 503]
        assert len(ok) + len(full) == 64, [r[0] for r in results]
        assert full and len(ok) >= 4
        for status, headers, spec_index, payload in full:
            assert headers.get("retry-after") == "1"
            assert payload["type"] == "ServiceUnavailableError" and payload["code"] == 503
            assert "--max-waiting" in payload["message"]
        for status, headers, spec_index, payload in ok:
            assert payload == expected[spec_index][0][0]
        wait_idle(server.url, 30)
    finally:
        server.stop()
    assert "Traceback" not in server.read_log()


async def _burst(url: str, specs: list[dict], count: int) -> list:
    async def one(http, i: int):
        spec = specs[i % len(specs)]
        body = {"model": "tiny", "prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
                "ignore_eos": True, "stream": bool(i % 2)}
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            raw = await resp.aread()
        if resp.status_code != 200:
            return resp.status_code, resp.headers, i % len(specs), json.loads(raw)["error"]
        if not body["stream"]:
            return 200, resp.headers, i % len(specs), json.loads(raw)["choices"][0]["text"]
        events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return 200, resp.headers, i % len(specs), "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as http:
        return await asyncio.gather(*(one(http, i) for i in range(count)))


# ---- SIGTERM during 16 streams ------------------------------------------------------------------

def _children(pid: int) -> set[int]:
    """Every live descendant of pid (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_during_16_streams_ends_each_and_leaves_no_worker(model_dir, tmp_path):
    grace = 4.0
    server = start(model_dir, tmp_path, "--tensor-parallel-size", "2", "--max-num-seqs", "4",
                   "--shutdown-timeout", str(grace))
    try:
        workers = _children(server.proc.pid)
        assert workers, "a tensor-parallel server has worker processes"
        lines = asyncio.run(asyncio.wait_for(_streams_then_sigterm(server, 16), 120))
        t0 = time.monotonic()
        assert server.wait(grace + 30) == 0, server.read_log()
        # the drain begins at SIGTERM: the process is gone within the grace and the engine's close
        assert time.monotonic() - t0 < grace + 20
    finally:
        server.stop()
    completed = aborted = 0
    for stream in lines:
        assert stream and stream[-1] == "[DONE]", stream[-3:]
        events = [json.loads(e) for e in stream[:-1]]
        if "error" in events[-1]:
            assert events[-1]["error"]["code"] == 503 and "shutting down" in events[-1]["error"]["message"]
            aborted += 1
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            completed += 1
    assert completed + aborted == 16
    time.sleep(0.5)
    assert not [pid for pid in workers if _alive(pid)], "a worker outlived the server"
    assert "Traceback" not in server.read_log()


async def _streams_then_sigterm(server: Server, count: int) -> list[list[str]]:
    started = [asyncio.Event() for _ in range(count)]

    async def one(http, i: int) -> list[str]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Story {i}"}], "temperature": 0,
                "max_tokens": 16 if i % 2 else 200, "ignore_eos": True, "stream": True}
        events = []
        async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started[i].set()
        return events

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as http:
        tasks = [asyncio.ensure_future(one(http, i)) for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # every stream is open
        server.signal(signal.SIGTERM)
        return await asyncio.gather(*tasks)


# ---- silent connections --------------------------------------------------------------------------

def _raise_own_fd_limit(want: int) -> int:
    """This process's soft descriptor limit raised toward `want` (up to the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends before it closes the connection (fails if it stays open)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_silent_connections_neither_lock_clients_out_nor_stay_open(model_dir, tmp_path):
    """2,000 connections that send nothing against a server with half as many descriptors
    (ulimit -n): /health and requests still answer; a connection whose request stalls
    (nothing, half the headers, half the body) is closed after --timeout-request-read."""
    silent = min(2000, _raise_own_fd_limit(2200) - 150)
    server = Server(model_dir, "--served-model-name", "tiny", "--max-model-len", str(MAX_LEN),
                    "--timeout-request-read", "5", log_path=str(tmp_path / "server.log"),
                    nofile=max(256, silent // 2)).start()
    socks: list[socket.socket] = []
    try:
        for _ in range(silent):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=30, max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage.completion_tokens == 3

        body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 3}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        stalls = {"nothing": b"", "half the headers": head[:40], "half the body": head + body[:10]}
        stalled = {}
        for name, sent in stalls.items():
            stalled[name] = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            stalled[name].sendall(sent)
        answers = {name: _read_until_closed(sock, 120) for name, sock in stalled.items()}
        for name in ("nothing", "half the headers"):
            assert answers[name].startswith(b"HTTP/1.1 408 "), (name, answers[name][:200])
            assert b'"RequestTimeoutError"' in answers[name] and b"--timeout-request-read" in answers[name]
        assert answers["half the body"] == b""  # the app was reading it: the read ends, nobody to answer
        for sock in stalled.values():
            sock.close()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    assert "Traceback" not in server.read_log()


def test_at_max_connections_an_idle_or_stalled_one_makes_room(model_dir, tmp_path):
    """At the cap a new connection closes the oldest one not being served and is served:
    one that sent nothing, and one that sent its headers but not all of its body (the
    app waits on the client: 16 such trickling uploads held every slot, /health got 503)."""
    server = Server(model_dir, "--served-model-name", "tiny", "--max-model-len", str(MAX_LEN),
                    "--max-connections", "16", log_path=str(tmp_path / "server.log")).start()
    # the app asks for the body (100 Continue) once it reads the request: its headers arrived
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: 100000\r\n\r\n")
    socks: list[socket.socket] = []
    try:
        socks += [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(16)]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert _read_until_closed(socks[0], 30) == b""
        for sock in socks:
            sock.close()
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(16)]
        for sock in socks:
            sock.sendall(head)
            assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
            sock.sendall(b'{"model": "tiny", ')
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert _read_until_closed(socks[0], 30) == b""  # the oldest upload made room
        for sock in socks:
            sock.close()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    assert "Traceback" not in server.read_log()


class _Readers(threading.Thread):
    """Reads (and drops) what arrives on these sockets until stopped: clients that keep
    reading their streams (one that stops reading may be closed at the cap)."""

    def __init__(self, socks: list[socket.socket]):
        super().__init__(daemon=True)
        self.socks, self.stop = socks, threading.Event()

    def run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for sock in self.socks:
                sel.register(sock, selectors.EVENT_READ)
            while not self.stop.is_set() and sel.get_map():
                for key, _ in sel.select(0.1):
                    try:
                        data = key.fileobj.recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(key.fileobj)


def _long_stream_server(checkpoint, tmp_path, *args: str) -> Server:
    long_len = 16384  # streams of up to 16k tokens: none ends on its own while a test runs
    return Server(checkpoint("qwen3-tiny", max_position_embeddings=long_len), "--served-model-name", "tiny",
                  "--max-model-len", str(long_len), "--kv-cache-memory-bytes", str(128 << 20),
                  "--shutdown-timeout", "0", *args, log_path=str(tmp_path / "server.log")).start()


def _long_stream(port: int, receive_buffer: int | None = None, **fields) -> socket.socket:
    """A connection that sends a long streaming request and has read the status line of its
    answer (it is being served); receive_buffer set before connecting sets the window."""
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": None, "ignore_eos": True, "stream": True,
                       **fields}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
    return sock


def _unread_stream(port: int) -> socket.socket:
    """A long stream whose client then reads nothing: a small receive buffer, so the
    server's writes soon back up."""
    return _long_stream(port, receive_buffer=4096, n=2, logprobs=5)


def _wait_healthy(url: str, timeout: float) -> int:
    """Poll /health until it answers 200 or `timeout` passes; its last status."""
    deadline = time.monotonic() + timeout
    while (status := httpx.get(url + "/health", timeout=30).status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    return status


def test_at_max_connections_when_every_one_is_being_served_a_new_one_gets_503(checkpoint, tmp_path):
    # 16 streams of up to 16k tokens each, read as they come: they cannot end while the
    # test runs, so each connection is being served
    server = _long_stream_server(checkpoint, tmp_path, "--max-connections", "16")
    socks: list[socket.socket] = []
    try:
        socks += [_long_stream(server.port) for _ in range(16)]
        readers = _Readers(socks)
        readers.start()
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as extra:
                # it sends nothing: a request the server never read would turn its close into a reset
                answer = _read_until_closed(extra, 30)
        finally:
            readers.stop.set()
            readers.join(30)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer.lower(), answer[:300]
        assert b"--max-connections" in answer
        for sock in socks:
            sock.close()
        assert _wait_healthy(server.url, 60) == 200  # the closed streams are aborted, their slots freed
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    assert "Traceback" not in server.read_log()


# ---- clients that stop reading -------------------------------------------------------------------

def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed the connection: reads what it sent until the end (the
    server's unsent bytes were dropped, what the kernels hold still arrives)."""
    try:
        _read_until_closed(sock, timeout)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_request_aborted(checkpoint, tmp_path):
    """A client that sends a streaming request and stops reading held its connection and
    its request's engine work for good (the app waited on the socket): after
    --timeout-response-write of paused writes the connection is dropped, the request
    aborted and its KV blocks freed."""
    server = _long_stream_server(checkpoint, tmp_path, "--timeout-response-write", "2")
    sock = None
    try:
        sock = _unread_stream(server.port)
        m = wait_idle(server.url, timeout=120)  # the stream cannot end on its own meanwhile
        assert successes(m) == 0, {k: v for k, v in m.items() if "success" in k}  # aborted, not finished
        assert _closed_by_server(sock, 60)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage.completion_tokens == 3
    finally:
        if sock is not None:
            sock.close()
        server.stop()
    assert "Traceback" not in server.read_log()


def test_at_max_connections_a_client_not_reading_its_stream_makes_room(checkpoint, tmp_path):
    """At the cap, connections whose clients stopped reading their streams are closed to
    make room (16 of them gave everyone, /health included, 503 until the streams' end)."""
    # a write timeout longer than the test: the cap, not the timeout, closes them
    server = _long_stream_server(checkpoint, tmp_path, "--max-connections", "16", "--timeout-response-write", "600")
    socks: list[socket.socket] = []
    try:
        socks += [_unread_stream(server.port) for _ in range(16)]
        # /health gets 503 until every stream's writes back up, then closes the oldest;
        # only a stalled stream could make room: the first whose writes backed up (its
        # client cannot tell without reading, which would let the others' streams go on)
        assert _wait_healthy(server.url, 120) == 200
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    assert "Traceback" not in server.read_log()
