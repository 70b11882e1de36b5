"""`nanokv merge` (and the end of a torchrun `generate`): the part files into the output."""

from __future__ import annotations

import os

from nanokv.entrypoints.cli.common import say
from nanokv.entrypoints.cli.locks import Locks
from nanokv.entrypoints.cli.records import (
    ERROR, RESULT, check_output_path, errors_path, exit_code, family, iter_records, load_keys, part_files, part_path, record_key)
from nanokv.fileio import write_durably


def finalize(output: str, locks: Locks) -> int:
    """Merge part files into `output` and the errors parts into its errors file, then
    remove the parts. Idempotent and crash safe: records whose id is already in the
    output are skipped, the output is fsynced before any part is removed, and an error
    whose id now has a result is dropped. Every file is locked and checked to be nanokv's
    before anything changes. Returns the number of error records left."""
    files = list(family(output))
    for _, _, target in files:
        locks.take(target)
    done: set[str] = set()
    for path, kind, target in files:  # check all (raises on a file nanokv did not write)
        load_keys(path, kind, done if (kind, target) == (RESULT, output) else set(), mine=True,
                  repair=target == output, evidence=locks.stale(target))
    for _, _, target in files:  # checked: a line a failed write tears from here on is nanokv's
        locks.settle(target)
    parts = [path for path, kind, target in files if kind == RESULT and target != output]
    with open(output, "ab") as f:
        for part in parts:
            for _, raw, rec in iter_records(part, RESULT):
                key = record_key(rec["id"], rec["line"])
                if key not in done:
                    f.write(raw)
                    done.add(key)
        f.flush()
        os.fsync(f.fileno())
    num_errors = _merge_errors(errors_path(output), done)
    for path, _, target in files:
        if target != output:
            os.remove(path)
    return num_errors


def _merge_errors(path: str, done: set[str]) -> int:
    errors: dict[str, bytes] = {}  # key -> latest record; errors are few
    for source in [path, *part_files(path)]:
        for _, raw, rec in iter_records(source, ERROR):
            key = record_key(rec["id"], rec["line"])
            if key not in done:
                errors.pop(key, None)
                errors[key] = raw
    if not errors:
        if os.path.exists(path):
            os.remove(path)
        return 0
    write_durably(path, errors.values())
    return len(errors)


def merge(args) -> int:
    check_output_path(args.output)
    expected = {part_path(args.output, r, args.world_size) for r in range(args.world_size)}
    present = set(part_files(args.output))
    locks = Locks("merge", args.output)
    try:
        locks.take(args.output)
        num_errors = finalize(args.output, locks)
    finally:
        locks.release()
    if not present:
        say(f"no part files of {args.output} to merge")
    elif expected - present:
        say(f"warning: missing {', '.join(sorted(expected - present))}; merged the others "
             "(rerun the generate command to finish the missing shards)")
    return exit_code(args.output, num_errors)
