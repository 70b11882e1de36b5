"""The nanokv command line.

    nanokv generate --model DIR --input prompts.jsonl --output out.jsonl [flags]
    nanokv merge --output out.jsonl --world-size N
    nanokv serve [MODEL] [--host H] [--port P] [flags]

generate.py runs a JSONL file through the engine; inputs.py reads it; records.py and
locks.py keep the files it writes safe to resume; merge.py joins torchrun part files;
serve.py starts the OpenAI-compatible server (nanokv/entrypoints/openai/); arguments.py
holds the flags. The README's "Batch generation CLI" section documents the
schemas, resume rules and exit codes.
"""

from __future__ import annotations

from nanokv.entrypoints.cli import generate, merge, serve
from nanokv.entrypoints.cli.arguments import build_parser
from nanokv.entrypoints.cli.common import EXIT_USAGE, InputError, RunFailed, say


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return serve.serve(args)
        return generate.generate(args) if args.command == "generate" else merge.merge(args)
    except (InputError, OSError, RunFailed) as e:  # bad ids, flags, model or paths; a failed engine or rank
        say(f"nanokv {args.command}: error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        say("interrupted; rerun the same command to resume")
        return 130
