"""bench.py --startup on the tiny checkpoint: cold and warm loads in new processes, the
server's ready time, peak RSS of each, and a llama-server found or not (a stand-in
binary here: the plumbing, not llama.cpp). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses and servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from benchmarks import startup  # noqa: E402
finally:
    sys.path.remove(ROOT)

# a llama-server stand-in: answers /health 503 ("loading") three times, then 200; records
# its pid and the /health requests it saw
FAKE_SERVER = """#!{python}
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
assert sys.argv[sys.argv.index("--host") + 1] == "127.0.0.1" and "-m" in sys.argv
record = {record!r}
seen = []

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen.append(self.path)
        with open(record, "w") as f:
            f.write(f"{{os.getpid()}} {{len(seen)}}")
        self.send_response(200 if len(seen) > 3 else 503)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_startup_reports_cold_warm_and_serve_with_peak_rss(model_dir, tmp_path):
    """Without the C kernels (no compile: a short test), on the tiny checkpoint: every
    number is there and positive; a model directory gives llama-server nothing to load."""
    env = dict(os.environ, NANOKV_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "bench.py", "--startup", "--model", model_dir, "--repeats", "2",
                          "--llama-server", sys.executable, "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    nk = report["nanokv"]
    assert len(nk["warm"]) == 2
    for run in [nk["cold"], *nk["warm"]]:
        assert run["import_seconds"] > 0 and run["load_seconds"] > 0
        assert run["process_seconds"] > run["import_seconds"] + run["load_seconds"]
        assert 10 << 20 < run["peak_rss_bytes"] < 4 << 30  # a real process, and not the KV pool's 4 GiB
    assert nk["serve"]["ready_seconds"] > 0 and nk["serve"]["peak_rss_bytes"] > 10 << 20
    assert "GGUF" in report["llama.cpp"]["missing"]


def test_llama_server_ready_time_waits_for_health_and_stops_it(tmp_path):
    record = tmp_path / "record"
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_SERVER.format(python=sys.executable, record=str(record)))
    fake.chmod(0o755)
    result = startup.llama_cpp_startup(str(fake), str(tmp_path / "model.gguf"), str(tmp_path), timeout=120)
    pid, seen = map(int, record.read_text().split())
    assert seen == 4  # three answers of 503 waited through, the 200 ended the wait
    assert result["serve"]["ready_seconds"] > 0 and result["serve"]["peak_rss_bytes"] > 1 << 20
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)
    assert startup.llama_cpp_startup(None, "m.gguf", str(tmp_path))["missing"].startswith("no llama-server")
    assert "GGUF" in startup.llama_cpp_startup(str(fake), None, str(tmp_path))["missing"]
