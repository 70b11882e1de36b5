"""scripts/gpu_check.sh --dry-run: every step of the GPU check runs at toy sizes on the
CPU and lands in $OUT/gpu_check.json (what a lent GPU runs, minus the GPU); a spent time
budget skips steps and fails the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = {"env", "checkpoint", "gpu_tests", "attention", "latency", "agreement", "nano_nanokv", "nano_hf"}


def run_check(out_dir, **env_changes):
    env = {**os.environ, "OUT": str(out_dir), "PYTHON": sys.executable, **env_changes}
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)


@pytest.mark.triton
def test_dry_run_runs_and_records_every_step(tmp_path):
    pytest.importorskip("triton")  # the attention step runs the Triton kernels (in the interpreter here)
    out = run_check(tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert set(steps) == STEPS | {"nano_ratio"}
    assert not any("status" in r for r in steps.values())  # none failed, timed out or was skipped
    assert steps["gpu_tests"]["counts"]["collected"] > 0 and steps["gpu_tests"]["failed"] == []
    assert [p["batch"] for p in steps["attention"]["points"]] == [1, 2]
    assert {(r["asked_graphs"], r["batch"]) for r in steps["latency"]["rows"]} == \
        {(g, b) for g in (True, False) for b in (1, 4)}
    assert steps["agreement"]["agreement"] == 1.0  # float32 on the CPU: token for token
    (nanokv,) = steps["nano_nanokv"]["results"]
    assert len(nanokv["runs"]) == 2 and "kv_pool_gib" in nanokv  # cold and warm
    assert steps["nano_ratio"]["ratio"] > 0
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"== {name} (at most" in log for name in STEPS) and "== summary ==" in log
    assert len(os.listdir(tmp_path)) <= 8  # what a lent machine sends back


def test_a_spent_budget_skips_the_steps_and_fails_the_check(tmp_path):
    out = run_check(tmp_path, GPU_CHECK_BUDGET="0")
    assert out.returncode == 1
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert set(steps) == STEPS and all(r == {"status": "skipped"} for r in steps.values())
