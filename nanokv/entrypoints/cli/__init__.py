"""The nanokv command line.

    nanokv generate [MODEL] --input prompts.jsonl --output out.jsonl [flags]
    nanokv merge --output out.jsonl --world-size N
    nanokv serve [MODEL] [--host H] [--port P] [flags]
    nanokv chat [MODEL] [--url URL] [flags]
    nanokv complete [MODEL] [--url URL] [flags]

arguments.py holds the flags and imports no torch: a subcommand's module is imported
only after the command line parsed, so --help and usage errors answer at once.
generate.py runs a JSONL file through the engine; inputs.py reads it; records.py and
locks.py keep the files it writes safe to resume; merge.py joins torchrun part files;
serve.py starts the OpenAI-compatible server (nanokv/entrypoints/openai/); chat.py is the
terminal chat and completion, on a local model or a server. docs/cli.md documents them.
"""

from __future__ import annotations

import sys

from nanokv.entrypoints.cli.arguments import build_parser
from nanokv.entrypoints.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, InputError, RunFailed, say


# vLLM's subcommands that nanokv has no command for, and what does their work here
_VLLM_ONLY_COMMANDS = {
    "bench": "benchmarks are run with bench.py from the repository (python bench.py --help; docs/benchmarks.md)",
    "run-batch": "nanokv generate runs a JSONL file of requests (nanokv generate --help; docs/cli.md)",
    "collect-env": "nanokv has no collect-env command; nanokv --version and pip list name the versions",
}


def main(argv: list[str] | None = None) -> int:
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command and command[0] in _VLLM_ONLY_COMMANDS:
        say(f"nanokv: {command[0]!r} is a vLLM command nanokv does not have: {_VLLM_ONLY_COMMANDS[command[0]]}")
        return EXIT_USAGE
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (InputError, OSError, RunFailed) as e:  # bad ids, flags, model or paths; a failed engine or rank
        say(f"nanokv {args.command}: error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.command in ("generate", "merge"):
            say("interrupted; rerun the same command to resume")
        return EXIT_INTERRUPTED


def _run(args) -> int:
    if args.command == "generate":
        from nanokv.entrypoints.cli.generate import generate

        return generate(args)
    if args.command == "merge":
        from nanokv.entrypoints.cli.merge import merge

        return merge(args)
    if args.command == "serve":
        from nanokv.entrypoints.cli.serve import serve

        return serve(args)
    from nanokv.entrypoints.cli.chat import chat, complete

    return chat(args) if args.command == "chat" else complete(args)
