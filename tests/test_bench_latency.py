"""bench.py --latency: nanokv's formats in new processes, round after round, and
llama-bench's report read back (a stand-in binary here: the plumbing, not llama.cpp). No
timing is asserted."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from benchmarks import latency  # noqa: E402
finally:
    sys.path.remove(ROOT)

# a llama-bench stand-in: records its arguments, prints llama-bench's JSON for them
# (one test per prompt length, then the generation test)
FAKE_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
open({record!r}, "w").write(json.dumps(args))
lens = [int(n) for n in args[args.index("-p") + 1].split(",")]
gen = int(args[args.index("-n") + 1])
tests = [dict(n_prompt=n, n_gen=0, avg_ts=1000.0 + n) for n in lens] + [dict(n_prompt=0, n_gen=gen, avg_ts=42.5)]
print(json.dumps(tests))
"""


@pytest.mark.slow  # engines in new processes
def test_latency_reports_every_round_of_every_format(model_dir):
    out = subprocess.run([sys.executable, "bench.py", "--latency", "--model", model_dir, "--repeats", "2",
                          "--prefill-lens", "40,72", "--quantization", "none,int8", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert list(report["engines"]) == ["nanokv", "nanokv int8"]
    assert report["prefill_lens"] == [40, 72] and report["rounds"] == 2
    for runs in report["engines"].values():
        assert len(runs) == 2
        for run in runs:
            assert run["decode"] > 0 and run["load_seconds"] > 0
            assert set(run["prefill"]) == {"40", "72"} and min(run["prefill"].values()) > 0
    assert "GGUF" in report["missing"]["llama.cpp"]  # a model directory: nothing llama.cpp loads
    assert out.stderr.count("round ") == 4  # every run reported as it ends


def test_llama_bench_report_read_back(tmp_path):
    record = tmp_path / "record"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH.format(python=sys.executable, record=str(record)))
    fake.chmod(0o755)
    result = latency.run_llama_once(str(fake), "m.gguf", [2048, 8000])
    assert result == {"decode": 42.5, "prefill": {"2048": 3048.0, "8000": 9000.0}}
    args = json.loads(record.read_text())
    assert args[args.index("-m") + 1] == "m.gguf" and args[args.index("-r") + 1] == "1"
    assert args[args.index("-n") + 1] == str(latency.DECODE_TOKENS)


def test_default_variants_are_every_weight_format():
    args = argparse.Namespace(dtype="float32", quantization="none", kv_cache_dtype="auto", cpu_width="native")
    assert [v.label for v in latency.latency_variants(args)] == [
        "nanokv", "nanokv int8", "nanokv int8+head", "nanokv bf16"]
    args = argparse.Namespace(dtype="float32", quantization="int8", kv_cache_dtype="auto", cpu_width="native")
    assert [v.label for v in latency.latency_variants(args)] == ["nanokv int8"]  # asked for: kept


def test_table_pairs_the_same_weight_bits(capsys):
    run = lambda d: {"decode": d, "prefill": {"2048": 1000.0}}  # noqa: E731
    latency.print_latency({"model": "m", "threads": 2, "rounds": 2, "prefill_lens": [2048], "missing": {},
                           "engines": {"nanokv": [run(60.0), run(70.0)], "nanokv int8+head": [run(130.0)],
                                       "llama.cpp q8_0": [run(100.0)], "llama.cpp f32": [run(50.0)]}})
    out = capsys.readouterr().out
    assert "| nanokv | 65.0 (60.0-70.0) | 1000.0 (1000.0-1000.0) |" in out
    assert "nanokv int8+head / llama.cpp q8_0 1.30x, nanokv / llama.cpp f32 1.30x" in out
