"""`python bench.py serve`: OpenAI-compatible servers under load, one fixed request list.

    python bench.py serve                              # SmolLM2: random, shared-prefix, multi-turn
    python bench.py serve --workload shared-prefix --engines nanokv,nanokv-no-prefix-cache
    python bench.py serve --llama-server ~/llama.cpp/build/bin/llama-server --json
    python bench.py serve --url nanokv=http://127.0.0.1:8000 --engines nanokv --workload random

Each engine's server is started here on a free loopback port (or taken from --url), waited
for (GET /health, then one short warm-up request), given the workload's requests, and
stopped; a fresh server per run, so no run inherits another's prefix cache. Every request
is a streaming chat completion (greedy, EOS ignored, so every engine produces the same
number of tokens) sent by one asyncio httpx client: TTFT is the time to the first chunk
with content, ITL the gaps between content chunks, TPOT (E2E - TTFT) / (tokens - 1), the
token counts the servers' usage (`stream_options.include_usage`). nanokv's /metrics gives
its prefix-cache hit rate and its peak KV use (polled during the run).

Engines: `nanokv` (`nanokv serve`), `nanokv-no-prefix-cache` (the same with
--no-enable-prefix-caching; on the workloads that share prefixes), `transformers`
(`transformers serve --continuous-batching`, offline, the same float32 weights and chat
template) and `llama.cpp` (`llama-server` on the GGUF itself, when --llama-server or PATH
has it). All get the same KV capacity in tokens (--kv-tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- workloads ----------------------------------------------------------------------------------

# Token counts are of the message contents; the chat template adds its own few tokens (and
# SmolLM2's template a default system prompt when a conversation has none).
WORKLOADS = {
    # vLLM's random dataset: independent requests, Poisson arrivals at --request-rates, and
    # one run at --max-concurrency
    "random": dict(num_requests=128, input=(64, 512), output=(32, 256)),
    # SGLang's generated-shared-prefix, scaled to 2 cores: groups of requests sharing a
    # long system prompt, at --max-concurrency
    "shared-prefix": dict(num_requests=128, groups=8, system=1024, question=128, output=128),
    # conversations at --max-concurrency (at most one request in flight per
    # conversation): each turn is sent with the whole history once the last answer came
    "multi-turn": dict(num_requests=64, turns=4, question=128, output=128),
}
ENGINES = ("nanokv", "nanokv-no-prefix-cache", "transformers", "llama.cpp")
LABELS = {"nanokv": "nanokv", "nanokv-no-prefix-cache": "nanokv, no prefix cache",
          "transformers": "transformers serve (CB)", "llama.cpp": "llama.cpp llama-server"}
SHARING = ("shared-prefix", "multi-turn")  # the workloads where the no-prefix-cache variant runs


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """One client's requests: its turns, each sent after the previous answer arrived."""

    system: str | None
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Load:
    rate: float | None  # sessions per second, Poisson; None: all at once
    max_concurrency: int | None  # sessions in flight at most; None: no bound

    @property
    def label(self) -> str:
        if self.rate is None:
            return f"concurrency {self.max_concurrency}" if self.max_concurrency else "all at once"
        return f"{self.rate:g} req/s" + (f", concurrency {self.max_concurrency}" if self.max_concurrency else "")


class _Words:
    """Random text of an exact token count: whole-word tokens (' word') drawn at random."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tokenizer, self.rng = tokenizer, rng
        words = set()
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            if re.fullmatch(r" [a-z]{2,}", text):
                words.add(text)
        if len(words) < 20:
            raise ValueError(f"the tokenizer has only {len(words)} whole-word tokens; give another model")
        self.words = sorted(words)

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def text(self, n: int) -> str:
        words = [self.rng.choice(self.words) for _ in range(n)]
        while True:  # merges across words are rare: trim or pad to n tokens
            text = "".join(words).strip()
            have = self.count(text)
            if have == n or not words:
                return text
            if have > n:
                words.pop()
            else:
                words.append(self.rng.choice(self.words))


def workload_spec(name: str, num_requests: int | None = None, scale: float = 1.0) -> dict:
    """WORKLOADS[name] with its request count replaced and its token counts scaled."""
    spec = dict(WORKLOADS[name], name=name)
    if not scale > 0:
        raise ValueError(f"--scale must be > 0, got {scale}")
    for key in ("input", "output", "system", "question"):
        if key in spec:
            value = spec[key]
            spec[key] = (tuple(max(1, round(v * scale)) for v in value) if isinstance(value, tuple)
                         else max(1, round(value * scale)))
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {num_requests}")
        spec["num_requests"] = num_requests
    return spec


def build_sessions(spec: dict, tokenizer, seed: int = 0) -> list[Session]:
    """A workload's request list (deterministic for a spec, a seed and a tokenizer)."""
    name = spec["name"]
    rng = random.Random(seed)
    words = _Words(tokenizer, rng)
    n = spec["num_requests"]
    if name == "random":
        return [Session(None, (Turn(words.text(rng.randint(*spec["input"])), rng.randint(*spec["output"])),))
                for _ in range(n)]
    if name == "shared-prefix":
        groups = min(spec["groups"], n)
        systems = [words.text(spec["system"]) for _ in range(groups)]
        sessions = [Session(systems[i % groups], (Turn(words.text(spec["question"]), spec["output"]),))
                    for i in range(n)]
        rng.shuffle(sessions)  # the groups interleave, as in SGLang's benchmark
        return sessions
    conversations = max(1, n // spec["turns"])
    return [Session(None, tuple(Turn(words.text(spec["question"]), spec["output"]) for _ in range(spec["turns"])))
            for _ in range(conversations)]


def loads_for(name: str, rates: list[float], max_concurrency: int) -> list[Load]:
    if name == "random":
        return [Load(r, None) for r in rates] + [Load(None, max_concurrency)]
    return [Load(None, max_concurrency)]


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Poisson arrivals (exponential gaps at `rate` per second), the first at 0."""
    if rate is None:
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ---- the engines ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Setup:
    """What every engine is given."""

    model_dir: str  # Hugging Face directory (float32) nanokv and transformers load
    gguf: str | None  # the GGUF file llama.cpp loads
    kv_tokens: int  # KV capacity of every engine, in tokens
    max_num_batched_tokens: int  # tokens per step (nanokv) / per batch (transformers, llama.cpp)
    threads: int
    llama_server: str | None
    startup_timeout: float
    log_dir: str


class Engine:
    """One engine's server: how to start it and what its requests look like."""

    def __init__(self, name: str, setup: Setup, url: str | None = None):
        self.name, self.setup, self.given_url = name, setup, url
        self.proc: subprocess.Popen | None = None
        self.url = url or ""
        self.model: str | None = "served"  # the request's "model"; None: leave it out
        self.log_path = os.path.join(setup.log_dir, f"{name}.log")

    @property
    def nanokv(self) -> bool:
        return self.name.startswith("nanokv")

    def command(self, port: int) -> tuple[list[str], dict]:
        s, env = self.setup, dict(os.environ)
        host = ["--host", "127.0.0.1", "--port", str(port)]
        if self.nanokv:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
            env.setdefault("TOKENIZERS_PARALLELISM", "false")
            cmd = [sys.executable, "-m", "nanokv", "serve", s.model_dir, *host, "--served-model-name", "served",
                   "--uvicorn-log-level", "warning", "--num-kvcache-blocks", str(s.kv_tokens // 16),
                   "--kvcache-block-size", "16", "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
            if self.name == "nanokv-no-prefix-cache":
                cmd.append("--no-enable-prefix-caching")
            return cmd, env
        if self.name == "transformers":
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
            script = os.path.join(os.path.dirname(sys.executable), "transformers")
            exe = [script] if os.path.exists(script) else [shutil.which("transformers") or "transformers"]
            # its page is 256 tokens; the KV capacity is given in pages, as nanokv's is in blocks
            return exe + ["serve", s.model_dir, "--continuous-batching", *host, "--device", "cpu", "--dtype",
                          "float32", "--log-level", "warning", "--cb-num-blocks", str(max(1, s.kv_tokens // 256)),
                          "--cb-max-batch-tokens", str(s.max_num_batched_tokens)], env
        # one KV pool shared by every slot (-kvu), as nanokv's and transformers' are (the same
        # KV budget, and prefixes shared across slots); 64 slots: the most sequences it runs at
        # once; flash attention on (what 'auto' picks on a CPU; with a shared pool, off is
        # several times slower)
        return [s.llama_server, "-m", s.gguf, *host, "--alias", "served", "-c", str(s.kv_tokens), "-kvu",
                "-fa", "on", "-np", "64", "-t", str(s.threads), "-tb", str(s.threads), "-b", str(s.max_num_batched_tokens),
                "--no-webui", "--log-disable"], env

    def body(self, messages: list[dict], max_tokens: int) -> dict:
        """A greedy streaming chat request that ignores EOS (every engine then makes
        max_tokens tokens)."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.name == "transformers":
            # transformers serve rejects unknown fields (ignore_eos): its own generation_config
            # field does it (eos -1: none)
            body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False})
        else:
            body["ignore_eos"] = True
        return body

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.given_url:
            self._discover_model()
            return
        for _ in range(3):  # a port taken between free_port() and the bind: another one
            port = free_port()
            cmd, env = self.command(port)
            self.url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "ab") as log:
                log.write(f"\n$ {' '.join(cmd)}\n".encode())
                self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            if self._wait_ready():
                self._discover_model()
                return
            exited = self.proc.poll() is not None
            self.stop()
            if not exited:
                break
        raise RuntimeError(f"{self.name} did not start within {self.setup.startup_timeout:.0f} s; its log "
                           f"({self.log_path}) ends:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        import httpx

        deadline = time.monotonic() + self.setup.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        return False

    def _discover_model(self) -> None:
        import httpx

        if self.name == "transformers":
            self.model = None  # pinned to its one model; the field must be its path or absent
            return
        try:
            models = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
            self.model = models[0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            self.model = None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""


# ---- the client --------------------------------------------------------------------------------

@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft: float = 0.0  # seconds to the first content chunk
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where a server reports it
    output_tokens: int = 0
    expected_tokens: int = 0
    text: str = ""
    server_timings: dict | None = None  # llama-server's own prompt_ms / predicted_ms


async def one_request(client, engine: Engine, messages: list[dict], max_tokens: int,
                      timeout: float) -> RequestResult:
    result = RequestResult(ok=False, expected_tokens=max_tokens)
    try:
        await asyncio.wait_for(_stream(client, engine, messages, max_tokens, result), timeout)
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"no answer within {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001 - a cut connection, a bad chunk: the request failed
        result.ok, result.error = False, f"{type(e).__name__}: {e}"[:200]
    return result


async def _stream(client, engine: Engine, messages: list[dict], max_tokens: int, result: RequestResult) -> None:
    """POST one streaming chat request and read its events into `result`."""
    start = time.perf_counter()
    pieces, chunks, last, done = [], 0, start, False
    async with client.stream("POST", engine.url + "/v1/chat/completions",
                             json=engine.body(messages, max_tokens)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {body[:200]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                result.error = f"error event: {str(obj['error'])[:200]}"
                return
            if obj.get("usage"):
                result.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                result.output_tokens = obj["usage"].get("completion_tokens", 0)
                details = obj["usage"].get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    result.cached_tokens = details["cached_tokens"]
            if obj.get("timings"):
                result.server_timings = obj["timings"]
            for choice in obj.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    if not chunks:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    pieces.append(content)
    result.e2e = time.perf_counter() - start
    result.text = "".join(pieces)
    if not result.output_tokens:  # no usage: one token per content chunk
        result.output_tokens = chunks
    result.ok = done or bool(result.output_tokens)
    if not result.ok:
        result.error = "the stream ended without [DONE]"


async def replay(engine: Engine, sessions: list[Session], load: Load, seed: int, timeout: float,
                 poll_metrics: bool) -> tuple[list[RequestResult], float, dict]:
    """Send every session's turns; (results, seconds from the first send to the last
    answer, the peak of nanokv's KV gauges while it ran)."""
    import httpx

    arrivals = arrival_times(len(sessions), load.rate, seed)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()
    results: list[RequestResult] = []
    peak = {"used_blocks": 0, "total_blocks": 0}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:
        start = time.perf_counter()

        async def session(i: int, s: Session) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                messages = [{"role": "system", "content": s.system}] if s.system else []
                for j, turn in enumerate(s.turns):
                    messages.append({"role": "user", "content": turn.user})
                    r = await one_request(client, engine, list(messages), turn.max_tokens, timeout)
                    results.append(r)
                    if not r.ok:  # the rest of the conversation cannot be sent
                        results.extend(RequestResult(False, "an earlier turn failed", expected_tokens=t.max_tokens)
                                       for t in s.turns[j + 1:])
                        return
                    messages.append({"role": "assistant", "content": r.text})

        async def poll() -> None:
            while True:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    m = parse_metrics((await client.get(engine.url + "/metrics", timeout=10)).text)
                    peak["used_blocks"] = max(peak["used_blocks"], int(m.get("nanokv:kv_cache_used_blocks", 0)))
                    peak["total_blocks"] = int(m.get("nanokv:kv_cache_total_blocks", 0))
                await asyncio.sleep(0.25)

        poller = asyncio.ensure_future(poll()) if poll_metrics else None
        try:
            await asyncio.gather(*(session(i, s) for i, s in enumerate(sessions)))
        finally:
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
        seconds = time.perf_counter() - start
    return results, seconds, peak


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for the samples labelled by model_name (and engine) alone."""
    values = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        if any(not part.startswith(("model_name=", "engine=")) for part in (labels or "").split(",") if part):
            continue  # finished_reason, le=...: not needed here
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return values


def nanokv_counters(url: str) -> dict[str, float]:
    import httpx

    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


# ---- statistics ---------------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float | None:
    """numpy's default (linear) percentile; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]

    def ms(values, p):
        v = percentile(values, p)
        return None if v is None else round(1000 * v, 1)

    summary = dict(
        completed=len(ok), failed=len(results) - len(ok), seconds=round(seconds, 2),
        output_tokens=tokens, expected_output_tokens=sum(r.expected_tokens for r in results),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tok_per_s=round(tokens / seconds, 1) if seconds > 0 else None,
        request_per_s=round(len(ok) / seconds, 3) if seconds > 0 else None,
        ttft_ms_p50=ms(ttft, 50), ttft_ms_p99=ms(ttft, 99), ttft_ms_mean=_mean_ms(ttft),
        tpot_ms_p50=ms(tpot, 50), tpot_ms_p99=ms(tpot, 99), tpot_ms_mean=_mean_ms(tpot),
        itl_ms_p50=ms(itl, 50), itl_ms_p99=ms(itl, 99),
        e2e_s_p50=None if not e2e else round(percentile(e2e, 50), 2),
        e2e_s_p99=None if not e2e else round(percentile(e2e, 99), 2),
        errors=sorted({r.error for r in results if not r.ok})[:5])
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:  # the server's own count of prompt tokens it did not compute (llama-server)
        summary["cached_prompt_tokens"] = sum(cached)
    timings = [r.server_timings for r in ok if r.server_timings]
    if timings:  # llama-server's own split of its time: prompt processing vs generation
        summary["server_prompt_ms"] = round(sum(t.get("prompt_ms", 0) for t in timings), 1)
        summary["server_predicted_ms"] = round(sum(t.get("predicted_ms", 0) for t in timings), 1)
        summary["server_prompt_tokens"] = sum(t.get("prompt_n", 0) for t in timings)
    return summary


def _mean_ms(values: list[float]) -> float | None:
    return round(1000 * sum(values) / len(values), 1) if values else None


# ---- a run ----------------------------------------------------------------------------------------

def run_one(engine: Engine, workload: str, sessions: list[Session], load: Load, args) -> dict:
    """A fresh server (unless --url), a warm-up request, the sessions, the server stopped."""
    engine.start()
    try:
        warm = asyncio.run(_warm_up(engine, args.request_timeout))
        if not warm.ok:
            raise RuntimeError(f"{engine.name}'s warm-up request failed: {warm.error}\n{engine.log_tail()}")
        before = nanokv_counters(engine.url) if engine.nanokv else {}
        results, seconds, peak = asyncio.run(replay(engine, sessions, load, args.seed, args.request_timeout,
                                                    engine.nanokv))
        row = dict(workload=workload, engine=engine.name, load=load.label, rate=load.rate,
                   max_concurrency=load.max_concurrency, requests=len(results), **summarize(results, seconds))
        if engine.nanokv:
            after = nanokv_counters(engine.url)
            queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get(
                "vllm:prefix_cache_queries_total", 0)
            hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
            total = peak["total_blocks"] or int(after.get("nanokv:kv_cache_total_blocks", 0))
            # a run shorter than the poll interval is seen by the server's own peak gauge (a
            # fresh server: its peak is this run's, or the one-request warm-up's if larger)
            peak["used_blocks"] = max(peak["used_blocks"], int(after.get("nanokv:kv_cache_peak_used_blocks", 0)))
            row["nanokv"] = dict(prefix_cache_hit_rate=round(hits / queries, 4) if queries else None,
                                 prefix_cache_hit_tokens=int(hits), prefix_cache_query_tokens=int(queries),
                                 peak_kv_used_blocks=peak["used_blocks"], kv_total_blocks=total,
                                 peak_kv_usage=round(peak["used_blocks"] / total, 4) if total else None,
                                 preemptions=int(after.get("vllm:num_preemptions_total", 0)
                                                 - before.get("vllm:num_preemptions_total", 0)))
        return row
    finally:
        engine.stop()


async def _warm_up(engine: Engine, timeout: float) -> RequestResult:
    """One short request with words no workload uses (it primes no prefix)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as client:
        return await one_request(client, engine, [{"role": "user", "content": "Warm up: count to five."}], 4,
                                 timeout)


# ---- the report -------------------------------------------------------------------------------------

COLUMNS = ("| workload | engine | load | completed / failed | output tok/s | request/s | TTFT p50 / p99 (ms) | "
           "TPOT p50 / p99 (ms) | ITL p99 (ms) | E2E p50 (s) | prefix-cache hits | peak KV |")


def _num(value, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def table_rows(rows: list[dict]) -> list[str]:
    lines = [COLUMNS, "|" + "---|" * COLUMNS.count(" | ") + "---|"]
    for r in rows:
        n = r.get("nanokv") or {}
        hits = "-" if n.get("prefix_cache_hit_rate") is None else f"{100 * n['prefix_cache_hit_rate']:.0f}%"
        if "cached_prompt_tokens" in r and r["prompt_tokens"]:  # as the server's usage reports it
            hits = f"{100 * r['cached_prompt_tokens'] / r['prompt_tokens']:.0f}% (usage)"
        peak = "-" if not n else f"{n['peak_kv_used_blocks']:,} / {n['kv_total_blocks']:,} blocks"
        lines.append(
            f"| {r['workload']} | {LABELS.get(r['engine'], r['engine'])} | {r['load']} | "
            f"{r['completed']} / {r['failed']} | {_num(r['output_tok_per_s'])} | {_num(r['request_per_s'], '.2f')} | "
            f"{_num(r['ttft_ms_p50'])} / {_num(r['ttft_ms_p99'])} | {_num(r['tpot_ms_p50'])} / "
            f"{_num(r['tpot_ms_p99'])} | {_num(r['itl_ms_p99'])} | {_num(r['e2e_s_p50'], '.1f')} | {hits} | {peak} |")
    return lines


def comparisons(rows: list[dict]) -> list[str]:
    """The issue's goals, as measured ratios (never asserted)."""
    lines = []
    by = {(r["workload"], r["load"], r["engine"]): r for r in rows if r["completed"]}
    for (workload, load, engine), nano in by.items():
        if engine != "nanokv":
            continue
        for peer in ("transformers", "llama.cpp"):
            other = by.get((workload, load, peer))
            if other and other["output_tok_per_s"]:
                lines.append(f"{workload}, {load}: nanokv / {LABELS[peer]} output tok/s "
                             f"{nano['output_tok_per_s'] / other['output_tok_per_s']:.2f}x; TTFT p99 "
                             f"{_num(nano['ttft_ms_p99'])} ms vs {_num(other['ttft_ms_p99'])} ms")
        cold = by.get((workload, load, "nanokv-no-prefix-cache"))
        if cold and nano["ttft_ms_p50"] and cold["ttft_ms_p50"]:
            lines.append(f"{workload}, {load}: TTFT p50 without / with the prefix cache "
                         f"{cold['ttft_ms_p50'] / nano['ttft_ms_p50']:.2f}x ({_num(cold['ttft_ms_p50'])} ms vs "
                         f"{_num(nano['ttft_ms_p50'])} ms)")
    return lines


# ---- main -------------------------------------------------------------------------------------------

def resolve_model(model: str, scratch: str) -> tuple[str, str | None]:
    """(a float32 Hugging Face directory, the GGUF file if the model is one). A GGUF (or a
    built-in name: smollm2) is dequantized into `scratch` for nanokv and transformers."""
    from nanokv.gguf import find_gguf, save_dequantized
    from nanokv.gguf import resolve_model as resolve_name

    gguf = find_gguf(resolve_name(model))
    if gguf is None:
        return model, None
    return save_dequantized(gguf, os.path.join(scratch, "model")), gguf


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a .gguf file, a built-in name (smollm2, the default) or a "
                                                      "Hugging Face directory (then llama.cpp needs --llama-gguf)")
    p.add_argument("--workload", default=",".join(WORKLOADS), help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)} "
                   "(nanokv-no-prefix-cache runs only on shared-prefix and multi-turn; llama.cpp only when "
                   "llama-server is found)")
    p.add_argument("--num-requests", type=int, help="requests per workload instead of its own (128, 128, 64); "
                                                    "shared-prefix splits them over 8 groups, multi-turn over "
                                                    "4-turn conversations")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every workload's token counts (prompts, outputs) by this (a smoke run: 0.25)")
    p.add_argument("--request-rates", default="0.5,1,2",
                   help="the random workload's Poisson arrival rates, requests/s (default 0.5,1,2; '': only "
                        "the concurrency run)")
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="clients in flight in the concurrency runs (random's last run, shared-prefix, multi-turn)")
    p.add_argument("--kv-tokens", type=int, default=32768, help="every engine's KV capacity in tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="tokens per step / batch, every engine")
    p.add_argument("--llama-server", help="the llama-server binary (default: llama-server on PATH, if any)")
    p.add_argument("--llama-gguf", help="the GGUF llama-server loads (default: --model's file)")
    p.add_argument("--url", action="append", default=[], metavar="ENGINE=URL",
                   help="use a running server for ENGINE instead of starting one (its caches then carry over "
                        "from run to run); repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=900, help="seconds one request may take")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to get ready")
    p.add_argument("--log-dir", help="where the servers' logs go (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workload.split(",") if w]
    args.engine_names = [e for e in args.engines.split(",") if e]
    bad = [w for w in args.workloads if w not in WORKLOADS] + [e for e in args.engine_names if e not in ENGINES]
    if bad or not args.workloads or not args.engine_names:
        p.error(f"unknown workload or engine {bad or ''}; workloads: {', '.join(WORKLOADS)}; "
                f"engines: {', '.join(ENGINES)}")
    try:
        args.rates = [float(x) for x in args.request_rates.split(",") if x]
        args.urls = dict(u.split("=", 1) for u in args.url)
    except ValueError:
        p.error("--request-rates takes numbers (1,2,4); --url takes ENGINE=URL")
    if any(r <= 0 for r in args.rates) or args.max_concurrency < 1 or args.kv_tokens < 256:
        p.error("rates must be > 0, --max-concurrency >= 1, --kv-tokens >= 256")
    try:
        args.specs = [workload_spec(w, args.num_requests, args.scale) for w in args.workloads]
    except ValueError as e:
        p.error(str(e))
    if args.llama_server and not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
        p.error(f"--llama-server {args.llama_server}: not an executable file")
    for name in args.urls:
        if name not in ENGINES:
            p.error(f"--url {name}=...: unknown engine; engines: {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C: the running server is stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nanokv-bench-serve-") as scratch:
        model_dir, gguf = resolve_model(args.model, scratch)
        llama = args.llama_server or shutil.which("llama-server")
        names = list(args.engine_names)
        if "llama.cpp" in names and "llama.cpp" not in args.urls and not (llama and (args.llama_gguf or gguf)):
            names.remove("llama.cpp")
            notes.append("llama.cpp skipped: " + ("no llama-server (give --llama-server PATH)" if not llama
                                                  else "no GGUF for it (give --llama-gguf)"))
        log_dir = args.log_dir or os.path.join(scratch, "logs")
        os.makedirs(log_dir, exist_ok=True)
        setup = Setup(model_dir, args.llama_gguf or gguf, args.kv_tokens, args.max_num_batched_tokens,
                      len(os.sched_getaffinity(0)), llama, args.startup_timeout, log_dir)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = []
        for workload, spec in zip(args.workloads, args.specs):
            sessions = build_sessions(spec, tokenizer, args.seed)
            for name in names:
                if name == "nanokv-no-prefix-cache" and workload not in SHARING:
                    continue
                engine = Engine(name, setup, args.urls.get(name))
                for load in loads_for(workload, args.rates, args.max_concurrency):
                    row = run_one(engine, workload, sessions, load, args)
                    rows.append(row)
                    print(f"# {workload}, {name}, {load.label}: {row['completed']} / {row['requests']} "
                          f"completed, {_num(row['output_tok_per_s'])} output tok/s", file=sys.stderr, flush=True)
    import torch

    report = dict(model=args.model, workloads={spec.pop("name"): spec for spec in args.specs}, scale=args.scale,
                  kv_tokens=args.kv_tokens, seed=args.seed,
                  machine=f"{len(os.sched_getaffinity(0))} CPU threads", torch=torch.__version__, notes=notes,
                  runs=rows, comparisons=comparisons(rows))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("\n".join(table_rows(rows)))
    failures = [f"{r['workload']}, {r['engine']}, {r['load']}: {r['failed']} failed: {'; '.join(r['errors'])}"
                for r in rows if r["failed"]]
    if report["comparisons"] or notes or failures:
        print("\n" + "\n".join(report["comparisons"] + notes + failures))
    return 0
