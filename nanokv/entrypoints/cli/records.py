"""The files `nanokv generate` writes: their names (output, errors file, torchrun parts),
the records in them, and the rule that makes them safe to resume.

nanokv changes only files it wrote: every complete line of a file it appends to or
repairs must be one of its records, and only a torn last line (one a kill cut short) is
ever cut.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import time
from collections.abc import Iterator

from nanokv.entrypoints.cli.common import EXIT_FAILED_LINES, EXIT_OK, InputError, RunFailed, say, valid_id
from nanokv.sampling_params import SamplingParams


def errors_path(output: str) -> str:
    """out.jsonl -> out.errors.jsonl; any other name gets .errors.jsonl appended."""
    stem = output[:-len(".jsonl")] if output.endswith(".jsonl") else output
    return stem + ".errors.jsonl"


def part_path(path: str, rank: int, world_size: int) -> str:
    return f"{path}.part-{rank:05d}-of-{world_size:05d}"


_PART_SUFFIX = re.compile(r"\.part-(\d+)-of-(\d+)$")


def part_files(path: str) -> list[str]:
    """Every part of `path` on disk, whatever world size wrote it, in name (rank) order."""
    return sorted(p for p in glob.glob(glob.escape(path) + ".part-[0-9]*-of-[0-9]*")
                  if _PART_SUFFIX.search(p[len(path):]))


def family(output: str) -> Iterator[tuple[str, str, str]]:
    """(path, kind, lock target) of every file a run on `output` reads and may change: the
    output, its errors file, and the parts of both; a part and its errors part share the
    lock of the output part."""
    errors = errors_path(output)
    yield output, RESULT, output
    yield errors, ERROR, output
    for kind, base in ((RESULT, output), (ERROR, errors)):
        for part in part_files(base):
            rank, world_size = map(int, _PART_SUFFIX.search(part[len(base):]).groups())
            yield part, kind, part_path(output, rank, world_size)


RESULT, ERROR = "result", "error"  # the two kinds of file nanokv writes


def lock_guards(output: str, target: str) -> tuple[str, str]:
    """The files under the lock of `target` (the output or one of its parts, as family()
    names them): it and its errors file."""
    suffix = target[len(output):]
    return target, errors_path(output) + suffix


_RESULT_KEYS = frozenset({"id", "line", "num_prompt_tokens", "text", "token_ids", "finish_reason", "stop_reason",
                          "num_completion_tokens", "cumulative_logprob", "logprobs", "outputs"})


def record_key(request_id, line: int) -> str:
    """Resume key: the JSON text of the id (so 1 and "1" differ); a line whose id is
    unknown (not a JSON object) is keyed by its line number."""
    return f"line:{line}" if request_id is None else json.dumps(request_id)


def _dumps(obj: dict) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: fall back to \u escapes
        return (json.dumps(obj, allow_nan=False) + "\n").encode("ascii")


def _record(raw: bytes, kind: str) -> dict | None:
    """The record on one complete line, or None when the line is not one nanokv writes in a
    file of this kind (a result, or {"id", "line", "error"})."""
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(rec, dict) or type(rec.get("line")) is not int:
        return None
    if kind == ERROR:
        ok = rec.keys() == {"id", "line", "error"} and isinstance(rec["error"], str) \
            and (rec["id"] is None or valid_id(rec["id"]))
    else:
        ok = rec.keys() <= _RESULT_KEYS and valid_id(rec.get("id")) and type(rec.get("num_prompt_tokens")) is int \
            and (isinstance(rec.get("outputs"), list) or isinstance(rec.get("token_ids"), list))
    return rec if ok else None


def iter_records(path: str, kind: str, *, strict: bool = True) -> Iterator[tuple[int, bytes, dict]]:
    """(end offset, raw line, record) of each complete line of `path` (nothing when it is
    missing), up to a torn last line (one without a newline). strict: a complete line that
    is not a nanokv record of `kind` raises InputError, since then nanokv did not write the
    file; otherwise such lines are passed over."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        end = 0
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return
            end += len(raw)
            rec = _record(raw, kind)
            if rec is not None:
                yield end, raw, rec
            elif strict:
                raise InputError(_not_ours(path, f"line {number} is not a nanokv {kind} record"))


def _not_ours(path: str, why: str) -> str:
    return (f"{path}: {why}, so nanokv did not write this file and will not change it; "
            "move it away or choose another --output")


def load_keys(path: str, kind: str, keys: set[str], *, mine: bool, repair: bool = False,
              evidence: bool = False) -> int:
    """Add the keys of `path`'s records to `keys`; returns how many.

    mine: this process holds the file's lock and may change it, so the file must be
    nanokv's: every complete line a record of `kind` (else InputError, before anything
    changes). Its torn last line (a write cut by a kill) is then cut off with repair, so
    that appends start clean. A file holding nothing but a torn line proves nothing; it is
    cut only with evidence (the lock file of a killed run was left beside it)."""
    count = end = 0
    for end, _, rec in iter_records(path, kind, strict=mine):
        keys.add(record_key(rec["id"], rec["line"]))
        count += 1
    if not mine or not os.path.exists(path):
        return count
    torn = os.path.getsize(path) - end
    if torn and not _torn_record(path, end):
        raise InputError(_not_ours(path, "its last line (without a newline) is not the start of a nanokv record"))
    if torn and not count and not evidence:
        raise InputError(_not_ours(path, "it holds no complete nanokv record, only a line without a newline"))
    if torn and repair:
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
        say(f"{path}: removed a torn last line of {torn} bytes; those requests are redone")
    return count


_RECORD_START = b'{"id": '  # how every record nanokv writes begins


def _torn_record(path: str, start: int) -> bool:
    """Whether the bytes from `start` (a last line without a newline) can be the start of
    a record nanokv was writing: its first bytes, or zeros a machine crash left."""
    with open(path, "rb") as f:
        f.seek(start)
        head = f.read(len(_RECORD_START))
    return _RECORD_START.startswith(head) or not head.strip(b"\0")


def result_record(request_id, line: int, out, params: SamplingParams) -> dict:
    """One finished RequestOutput as a JSON object (schema in the README)."""
    rec = {"id": request_id, "line": line, "num_prompt_tokens": len(out.prompt_token_ids)}
    completions = [_completion_record(c, params) for c in out.outputs]
    if params.n == 1:
        rec.update(completions[0])
    else:
        rec["outputs"] = completions
    return rec


def _completion_record(c, params: SamplingParams) -> dict:
    rec = {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason, "num_completion_tokens": len(c.token_ids)}
    if params.n > 1:
        rec = {"index": c.index, **rec}
    if params.logprobs is not None:
        rec["cumulative_logprob"] = _finite(c.cumulative_logprob)
        rec["logprobs"] = [
            [{"token_id": tid, "logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()]
            for entry in c.logprobs or []]
    return rec


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def error_record(request_id, line: int, reason: str) -> dict:
    return {"id": request_id, "line": line, "error": reason}


class JsonlWriter:
    """Append-only JSONL output. Flushed by the caller after each engine step (a kill
    loses nothing that was flushed); fsynced every `fsync_every` records or
    `fsync_seconds` seconds (a machine crash loses at most that much, which resume redoes).
    Opened on the first write, so a run without errors leaves no errors file. A write that
    fails (disk full, quota, file size limit) raises RunFailed; the record it cut short is
    the torn last line a resume cuts (the lock file stays as the trace that the file is
    nanokv's)."""

    def __init__(self, path: str, fsync_every: int, fsync_seconds: float):
        self.path = path
        self.fsync_every, self.fsync_seconds = fsync_every, fsync_seconds
        self._f = None
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def open(self) -> "JsonlWriter":
        if self._f is None:
            with self._write_errors():
                self._f = open(self.path, "ab")
        return self

    def write(self, rec: dict) -> None:
        data = _dumps(rec)
        with self._write_errors():
            self.open()._f.write(data)
        self._unsynced += 1

    def flush(self) -> None:
        if self._f is None:
            return
        with self._write_errors():
            self._f.flush()
            if self._unsynced and (self._unsynced >= self.fsync_every
                                   or time.monotonic() - self._last_sync >= self.fsync_seconds):
                self._sync()

    def _sync(self) -> None:
        os.fsync(self._f.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._f is None:
            return
        with self._write_errors():
            try:
                self._f.flush()
                self._sync()
            finally:  # also after a failed write: what did not fit is dropped, never written later
                f, self._f = self._f, None
                f.close()

    @contextlib.contextmanager
    def _write_errors(self):
        try:
            yield
        except OSError as e:
            raise RunFailed(f"cannot write {self.path}: {e.strerror or e}; make room (disk space, quota, "
                            "file size limit) and rerun the same command to resume") from e


def exit_code(output: str, num_errors: int) -> int:
    if num_errors:
        say(f"{num_errors} lines failed; see {errors_path(output)}")
        return EXIT_FAILED_LINES
    return EXIT_OK


def check_output_path(output: str) -> str:
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise InputError(f"the directory of --output {output} does not exist: create {directory} first")
    if os.path.exists(output) and not os.path.isfile(output):
        kind = "a directory" if os.path.isdir(output) else "not a regular file"
        raise InputError(f"--output {output} is {kind}; give a file name")
    return directory
