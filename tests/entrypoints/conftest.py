"""A `nanokv serve` subprocess on a free loopback port: started by a fixture, waited for
(/health), always stopped (SIGTERM, then SIGKILL), its log shown when it fails."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else REPO
    env["OMP_NUM_THREADS"] = "1"  # 2 shared cores: spinning OpenMP workers slow everyone down
    env.pop("NANOKV_API_KEY", None)
    return env


def serve(model: str, *args: str, log_path: str, **kwargs):
    """For a fixture: `yield from serve(...)` yields a started Server and stops it when the
    fixture ends (also when its start fails)."""
    server = Server(model, *args, log_path=log_path, **kwargs)
    try:
        yield server.start()
    finally:
        server.stop()


class Server:
    """`python -m nanokv serve MODEL ARGS --port P`; stop() in a finally."""

    def __init__(self, model: str, *args: str, log_path: str, nofile: int | None = None):
        # HTTP/1.1's keep-alive race: a client that reuses an idle connection just as the
        # server's idle timer (5 s) closes it gets a connection error. Clients retry those
        # (openai's SDK twice); these tests send with max_retries=0 to count every request
        # once, and a loaded 2-core machine can hold a connection idle for 5 s while the
        # client reads behind the server (200 streams beside two CPU hogs: 3 runs in 27; CI
        # once). An idle time longer than any test rules the race out; a test's own
        # --timeout-keep-alive comes later and wins.
        self.model, self.args, self.log_path = model, ["--timeout-keep-alive", "600", *args], log_path
        self.nofile = nofile  # the server's file descriptor limit, soft and hard (ulimit -n)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "Server":
        for _ in range(3):  # a port taken between free_port() and the bind: try another
            self.port = free_port()
            self.log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nanokv", "serve", self.model, "--host", "127.0.0.1", "--port",
                 str(self.port), "--uvicorn-log-level", "warning", *self.args],
                env=server_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=None if self.nofile is None else self._limit_descriptors)
            if self._wait_healthy(timeout):
                return self
            alive = self.proc.poll() is None
            self.stop()
            if alive:  # not a lost port race: it hung
                break
        raise RuntimeError(f"the server did not start:\n{self.read_log()}")

    def _limit_descriptors(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def _wait_healthy(self, timeout: float) -> bool:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def read_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def start_server(tmp_path):
    """start_server(model, *args) -> a running Server, stopped at teardown."""
    servers = []

    def start(model: str, *args: str) -> Server:
        server = Server(model, *args, log_path=str(tmp_path / f"server-{len(servers)}.log"))
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def metrics(url: str) -> dict:
    """GET /metrics parsed with prometheus_client: {sample name + sorted labels: value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            values[key] = sample.value
    return values


def wait_idle(url: str, timeout: float = 10) -> dict:
    """The metrics once nothing runs or waits and no KV block is in use; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["nanokv:kv_cache_used_blocks"], m["vllm:kv_cache_usage_perc"],
                m["nanokv:kv_cache_fragmentation_tokens"]) == (0, 0, 0, 0, 0)
        if idle or time.monotonic() > deadline:
            assert idle, {k: v for k, v in m.items() if "bucket" not in k}
            return m
        time.sleep(0.05)
