"""The command line's parser: --help without torch, --version, each default shown once and
meaningfully, a subcommand's errors with that subcommand's usage, the positional model."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import nanokv
from nanokv.entrypoints.cli import main
from nanokv.entrypoints.cli.arguments import build_parser, engine_args_from_cli
from nanokv.entrypoints.cli.common import InputError, Rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ["generate", "serve", "chat", "complete", "merge"]

# Runs `nanokv ARGV` as the console script does and reports the exit code and which heavy
# modules were imported by then.
_PROBE = """
import json, runpy, sys
sys.argv = ["nanokv", *json.loads(sys.argv[1])]
try:
    runpy.run_module("nanokv", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as e:
    code = e.code
heavy = [m for m in ("torch", "transformers", "numpy", "tqdm", "fastapi", "uvicorn") if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _probe(argv: list[str]) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                          env=env, timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout + proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["bogus"],
                                  *([c, "--help"] for c in COMMANDS),
                                  ["generate", "--input", "i", "--output", "o", "--max-tokens", "x"],
                                  ["chat", "--no-such-flag"]])
def test_help_version_and_usage_errors_import_neither_torch_nor_transformers(argv):
    result, output = _probe(argv)
    assert result["code"] == (2 if argv[0] == "bogus" or "--help" not in argv and "--version" not in argv else 0), \
        output
    assert result["heavy"] == [], output


def test_version_prints_nanokv_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == nanokv.__version__


@pytest.mark.parametrize("argv", [
    ["generate", "--input", "i", "--output", "o", "--no-such-flag"],  # unknown: argparse's top parser reports these
    ["generate", "--input", "i", "--output", "o", "--temperature", "hot"],
    ["generate", "--input", "i"],
    ["serve", "--no-such-flag"],
    ["chat", "--max-tokens", "many"],
    ["complete", "m", "extra-positional"],
    ["merge", "--output", "o"],
])
def test_an_error_in_a_subcommand_prints_that_subcommands_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: nanokv {argv[0]} "), err
    assert f"\nnanokv {argv[0]}: error: " in err, err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return build_parser().commands


def test_help_shows_every_default_once_and_never_a_bare_none():
    formatter = build_parser().commands["generate"]._get_formatter()
    for help, shown in (("a limit; None: the model's", "a limit (default: the model's)"),
                        ("lines a log shows (None: all)", "lines a log shows (default: all)"),
                        ("a key (unset: $KEY)", "a key (unset: $KEY)"), ("a file", "a file (default: not set)")):
        assert formatter._get_help_string(argparse.Action(["--x"], "x", default=None, help=help)) == shown
    for name, parser in _subparsers().items():
        text = " ".join(parser.format_help().split())
        assert "default: None" not in text and "default: True)" not in text.split("--no-enable-prefix-caching")[0]
        for action in parser._actions:
            if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            formatter = parser._get_formatter()
            formatter.add_argument(action)
            entry = " ".join(formatter.format_help().split())
            switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
            expected = 0 if switch or action.required else 1
            said = entry.count("default:") + (action.default is None and "(unset: " in entry)
            assert said == expected, (name, entry)
            assert "None" not in entry.split("(default: ")[-1], (name, entry)  # what None means, in words
            if not switch and action.default is not None and not action.required and "default:" not in action.help:
                assert f"(default: {action.default})" in entry, (name, entry)


def test_prefix_caching_has_vllms_spelling_and_a_hidden_alias():
    gen = _subparsers()["generate"]
    help_text = gen.format_help()
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in help_text
    assert "--no-prefix-caching" not in help_text.replace("--no-enable-prefix-caching", "")
    base = ["--input", "i", "--output", "o"]
    for flags, enabled in (([], True), (["--no-enable-prefix-caching"], False), (["--no-prefix-caching"], False),
                           (["--no-prefix-caching", "--enable-prefix-caching"], True)):
        assert engine_args_from_cli(gen.parse_args(base + flags), Rank()).enable_prefix_caching is enabled


@pytest.mark.parametrize("command", ["generate", "chat", "complete", "serve"])
def test_the_model_is_positional_or_model_but_given_once(command):
    parser = build_parser()
    extra = ["--input", "i", "--output", "o"] if command == "generate" else []
    for argv in ([command, "my-model", *extra], [command, *extra, "--model", "my-model"],
                 [command, "my-model", *extra, "--model", "my-model"]):
        assert engine_args_from_cli(parser.parse_args(argv), Rank()).model == "my-model", argv
    with pytest.raises(InputError, match="given twice"):
        engine_args_from_cli(parser.parse_args([command, "one", *extra, "--model", "two"]), Rank())


def test_the_package_version_is_nanokv_version(tmp_path):
    """pyproject.toml reads the version off nanokv.__version__: one source for --version,
    the package metadata and GET /version."""
    setuptools_config = pytest.importorskip("setuptools.config.pyprojecttoml")
    (tmp_path / "nanokv").mkdir()
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        (tmp_path / "pyproject.toml").write_text(f.read())
    (tmp_path / "README.md").write_text("readme\n")
    with open(os.path.join(REPO, "nanokv", "__init__.py")) as f:
        source = f.read()
    assert f'__version__ = "{nanokv.__version__}"' in source
    (tmp_path / "nanokv" / "__init__.py").write_text(source.replace(nanokv.__version__, "9.8.7"))
    config = setuptools_config.read_configuration(str(tmp_path / "pyproject.toml"))
    assert config["project"]["version"] == "9.8.7"


@pytest.mark.parametrize("command, where", [("bench", "bench.py"), ("run-batch", "nanokv generate")])
def test_vllm_commands_nanokv_lacks_name_what_does_their_work(command, where, capsys):
    assert main([command, "--model", "x"]) == 2
    err = capsys.readouterr().err
    assert "vLLM command" in err and where in err
