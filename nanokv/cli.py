"""The nanokv command line.

    nanokv generate --model DIR --input prompts.jsonl --output out.jsonl [flags]
    nanokv merge --output out.jsonl --world-size N

`generate` is offline batch generation: JSONL in, JSONL out, one record per input line
written as soon as it finishes. It is resumable (records already in the output, or in the
errors file, are not redone; a torn last line is cut off and redone) and data parallel
under torchrun (rank r takes the input lines whose 0-based index is r modulo the world
size, writes its own part files, and rank 0 merges them at the end). The README's
"Batch generation CLI" section documents the schemas, resume rules and exit codes.

Safety rules, all checked before the model loads: nanokv changes only files it wrote (every
complete line of an output it appends to or repairs must be one of its records, and only a
torn last line is ever cut); the input is never one of the outputs; one run at a time holds
an output (an flock'ed `<output>.lock` naming the holder); an input that can be read only
once (`-`, a pipe) is first copied to an anonymous temporary file.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from nanokv.sampling_params import SamplingParams

EXIT_OK = 0
EXIT_USAGE = 2  # bad flags, ids or paths, a model that does not load, a failed engine or rank
EXIT_FAILED_LINES = 3  # the job ran, but some lines are in the errors file

logger = logging.getLogger("nanokv")

_BLANK = object()  # a blank input line: skipped, not a request
_MISSING = object()  # a JSON object without "id"
_NULL_ID = object()  # "id": null, which is no id
_PROMPT_FORMS = ("prompt", "messages", "prompt_token_ids")
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class InputError(ValueError):
    """The input as a whole is unusable (duplicate or missing ids), or a path is (a file
    nanokv did not write, the input named as output, a missing directory, a held lock)."""


class RunFailed(Exception):
    """The run cannot go on: the engine failed (a dead worker, a closed engine) or another
    torchrun rank did. What was flushed stays; rerunning the command resumes."""


# ---- file names ---------------------------------------------------------------------

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


def _family(output: str) -> Iterator[tuple[str, str, str]]:
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


# ---- records ------------------------------------------------------------------------

RESULT, ERROR = "result", "error"  # the two kinds of file nanokv writes
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
            and (rec["id"] is None or _valid_id(rec["id"]))
    else:
        ok = rec.keys() <= _RESULT_KEYS and _valid_id(rec.get("id")) and type(rec.get("num_prompt_tokens")) is int \
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
        _say(f"{path}: removed a torn last line of {torn} bytes; those requests are redone")
    return count


_RECORD_START = b'{"id": '  # how every record nanokv writes begins


def _torn_record(path: str, start: int) -> bool:
    """Whether the bytes from `start` (a last line without a newline) can be the start of
    a record nanokv was writing: its first bytes, or zeros a machine crash left."""
    with open(path, "rb") as f:
        f.seek(start)
        head = f.read(len(_RECORD_START))
    return _RECORD_START.startswith(head) or not head.strip(b"\0")


# ---- locks --------------------------------------------------------------------------

class FileLock:
    """An exclusive flock(2) on `<target>.lock`, a file naming its holder. The kernel drops
    the lock when the holder dies, so a killed run never blocks its resume; a lock file
    left behind is the trace of a run that did not finish (`stale`), which is what lets a
    file holding only a torn line be cut. Removed on release while still locked: whoever
    opened the old file before then finds it unlinked after its flock and retries."""

    def __init__(self, target: str, holder: str):
        self.target, self.path = target, target + ".lock"
        self.stale = False  # it named a holder when taken: a run on these files was killed
        self.settled = False  # the files it guards were checked and repaired since
        self._fd = self._acquire(holder)

    def _acquire(self, holder: str) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise InputError(f"cannot create the lock file {self.path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held_by = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another nanokv process"
                os.close(fd)
                raise InputError(f"{self.target} is in use by {held_by} (it holds {self.path}); "
                                 "wait for that run to end or stop it") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed it between our open and flock
        previous = os.pread(fd, 512, 0)
        if previous and not previous.startswith(b"nanokv "):
            os.close(fd)
            raise InputError(f"{self.path} exists and nanokv did not write it; move it away")
        self.stale = bool(previous)
        line = f"nanokv {holder} pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, line.encode(), 0)
        os.fsync(fd)  # the trace must outlive a machine crash too
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        if self.settled or not self.stale:  # else keep the trace of the killed run
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class Locks:
    """The locks this process holds, by the path each guards (an output or an output part)."""

    def __init__(self, holder: str):
        self.holder = holder
        self._held: dict[str, FileLock] = {}

    def take(self, target: str) -> FileLock:
        if target not in self._held:
            self._held[target] = FileLock(target, self.holder)
        return self._held[target]

    def __contains__(self, target: str) -> bool:
        return target in self._held

    def stale(self, target: str) -> bool:
        return target in self._held and self._held[target].stale

    def settle(self, target: str) -> None:
        self._held[target].settled = True

    def release(self) -> None:
        for lock in self._held.values():
            lock.release()
        self._held.clear()


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
    Opened on the first write, so a run without errors leaves no errors file."""

    def __init__(self, path: str, fsync_every: int, fsync_seconds: float):
        self.path = path
        self.fsync_every, self.fsync_seconds = fsync_every, fsync_seconds
        self._f = None
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def open(self) -> "JsonlWriter":
        if self._f is None:
            self._f = open(self.path, "ab")
        return self

    def write(self, rec: dict) -> None:
        self.open()._f.write(_dumps(rec))
        self._unsynced += 1

    def flush(self) -> None:
        if self._f is None:
            return
        self._f.flush()
        if self._unsynced and (self._unsynced >= self.fsync_every
                               or time.monotonic() - self._last_sync >= self.fsync_seconds):
            self._sync()

    def _sync(self) -> None:
        os.fsync(self._f.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            self._sync()
            self._f.close()
            self._f = None


# ---- input --------------------------------------------------------------------------

@dataclass
class Source:
    """The input, opened once for both the id scan and the read. `-` and pipes can be read
    only once, so they are first copied to an anonymous temporary file (removed by the
    kernel when the process ends, even when it is killed)."""

    name: str
    f: BinaryIO
    identity: tuple[int, int] | None  # (device, inode) of what the user named, if a regular file
    _stamp: tuple[int, int] | None = None

    def mark(self) -> None:
        """Remember the size and modification time the ids were scanned at."""
        self._stamp = self._now()

    def check_unchanged(self) -> None:
        if self._now() != self._stamp:
            raise InputError(f"{self.name} changed during the run (its size or modification time is not what "
                             "the id scan saw); results so far are kept, rerun on the final input to resume")

    def _now(self) -> tuple[int, int]:
        st = os.fstat(self.f.fileno())
        return st.st_size, st.st_mtime_ns


def open_input(name: str, spool_dir: str, *, spool: bool = True) -> Source:
    """The input as a Source; a non-regular file (or `-`, stdin) is spooled into spool_dir
    (the output's directory: it has room for data of this size, unlike a small /tmp)."""
    f = os.fdopen(os.dup(sys.stdin.fileno()), "rb") if name == "-" else open(name, "rb")
    st = os.fstat(f.fileno())
    identity = (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
    if name != "-" and identity is not None:
        return Source(name, f, identity)
    with f:
        if not spool:
            raise InputError(f"--input {name} is not a regular file; under torchrun every rank reads the input, "
                             "so give a file")
        copy = tempfile.TemporaryFile(dir=spool_dir, prefix=".nanokv-input-")
        try:
            shutil.copyfileobj(f, copy, 1 << 20)
        except BaseException:
            copy.close()
            raise
    copy.seek(0)
    return Source(name, copy, identity)


@dataclass
class Scan:
    """What the id scan keeps of the input: the id of each line (index = line number - 1),
    None where the line is no JSON object, _BLANK for blank lines; and the id each renamed
    line (--allow-duplicate-ids) carries itself."""

    ids: list
    renamed: dict[int, object]


def scan_ids(path: str, *, allow_duplicate_ids: bool = False, id_from_line: bool = False) -> list:
    """One pass over the input keeping only ids (see Scan). Raises InputError naming the
    lines of duplicate, missing or malformed ids.

    allow_duplicate_ids: the k-th occurrence (k >= 2) of an id becomes "<id>#<k>".
    id_from_line: a line without "id" gets its line number (an int) as id."""
    with open(path, "rb") as f:
        return _scan(f, path, allow_duplicate_ids, id_from_line).ids


def _scan(f: BinaryIO, name: str, allow_duplicate_ids: bool, id_from_line: bool) -> Scan:
    scan = Scan([], {})
    first_line: dict[str, int] = {}
    occurrences: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    missing: list[int] = []
    malformed: list[str] = []
    for line, raw in enumerate(f, 1):
        if not raw.strip():
            scan.ids.append(_BLANK)
            continue
        request_id = _line_id(raw, line, id_from_line)
        if request_id is _MISSING:
            missing.append(line)
            request_id = None
        elif request_id is not None and not _valid_id(request_id):
            malformed.append(f"line {line}: {'null' if request_id is _NULL_ID else repr(request_id)}")
            request_id = None
        if request_id is not None:
            key = record_key(request_id, line)
            if allow_duplicate_ids:
                k = occurrences[key] = occurrences.get(key, 0) + 1
                if k > 1:
                    scan.renamed[line - 1] = request_id
                    request_id = f"{request_id}#{k}"
                    key = record_key(request_id, line)
            if key in first_line:
                duplicates.setdefault(key, [first_line[key]]).append(line)
            else:
                first_line[key] = line
        scan.ids.append(request_id)
    _raise_id_problems(name, duplicates, missing, malformed, allow_duplicate_ids)
    return scan


def _line_id(raw: bytes, line: int, id_from_line: bool):
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting too deep to parse
        return None
    if not isinstance(obj, dict):
        return None
    if "id" in obj:
        return _NULL_ID if obj["id"] is None else obj["id"]
    return line if id_from_line else _MISSING


def _valid_id(request_id) -> bool:
    return isinstance(request_id, str) or (isinstance(request_id, int) and not isinstance(request_id, bool))


def _raise_id_problems(path, duplicates, missing, malformed, allow_duplicate_ids) -> None:
    problems = []
    if duplicates:
        listed = "; ".join(f"{k} on lines {', '.join(map(str, lines))}"
                           for k, lines in list(duplicates.items())[:10])
        more = f" (and {len(duplicates) - 10} more)" if len(duplicates) > 10 else ""
        fix = ("make the renamed ids unique" if allow_duplicate_ids
               else "make ids unique or pass --allow-duplicate-ids")
        problems.append(f"duplicate ids: {listed}{more}; {fix}")
    if missing:
        problems.append(f"no \"id\" on lines {_lines(missing)}; add ids or pass --id-from-line")
    if malformed:
        problems.append("an id must be a string or an integer: " + "; ".join(malformed[:10])
                        + (f" (and {len(malformed) - 10} more)" if len(malformed) > 10 else ""))
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems) + "; nothing was run")


def _lines(lines: list[int]) -> str:
    shown = ", ".join(map(str, lines[:20]))
    return shown + (f" (and {len(lines) - 20} more)" if len(lines) > 20 else "")


@dataclass
class Item:
    """One input line of this rank's shard, parsed: a request, or the reason it is none."""

    line: int
    request_id: object
    prompt: str | list[int] | dict | None = None
    params: SamplingParams | None = None
    error: str | None = None


def parse_request(raw: bytes, tokenizer, base: SamplingParams, seed_for=None):
    """An input line -> (prompt for add_request, SamplingParams). ValueError says what is
    wrong with the line. seed_for(): the seed of a line that sets none (or None)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a line must be a JSON object, got {type(obj).__name__}")
    forms = [k for k in _PROMPT_FORMS if k in obj]
    if len(forms) != 1:
        raise ValueError(f"a line needs exactly one of {', '.join(map(repr, _PROMPT_FORMS))}, got "
                         + (", ".join(map(repr, forms)) if forms else "none"))
    params = _line_params(obj.get("sampling_params"), base, seed_for)
    value = obj[forms[0]]
    if forms[0] == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
        if not value:
            raise ValueError("prompt is empty; give at least one token")
        return value, params
    if forms[0] == "prompt_token_ids":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError("'prompt_token_ids' must be a list of integers")
        return value, params
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise ValueError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    from nanokv.llm import render_chat

    return render_chat(tokenizer, value), params


def _line_params(overrides, base: SamplingParams, seed_for) -> SamplingParams:
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ValueError(f"'sampling_params' must be an object, got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - _SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling_params keys {unknown}; known: {sorted(_SAMPLING_FIELDS)}")
    try:
        params = dataclasses.replace(base, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad sampling_params: {e}") from None
    if params.seed is None and seed_for is not None:
        params = dataclasses.replace(params, seed=seed_for())
    return params


def line_seed(engine_seed: int, key: str) -> int:
    """The seed of a request that sets none: a hash of (--seed, its id), so sampled output
    does not depend on batching, resume or sharding."""
    digest = hashlib.blake2b(f"{engine_seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ---- generate -----------------------------------------------------------------------

@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Rank":
        """torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process without them."""
        try:
            r = cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                    int(os.environ.get("LOCAL_RANK", 0)))
        except ValueError as e:
            raise InputError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {e}") from None
        if not 0 <= r.rank < r.world_size:
            raise InputError(f"RANK={r.rank} is outside WORLD_SIZE={r.world_size}")
        return r

    def owns(self, index: int) -> bool:
        return index % self.world_size == self.rank


@dataclass
class Counts:
    todo: int = 0  # lines of this shard to run
    done: int = 0  # finished this run
    failed: int = 0  # errors recorded this run
    skipped: int = 0  # already in the output
    skipped_errors: int = 0  # already in the errors file
    completion_tokens: int = 0


@dataclass(frozen=True)
class ShardFiles:
    """Where one process writes: the output itself, or its part files under torchrun."""

    output: str
    errors: str

    @classmethod
    def of(cls, output: str, rank: Rank) -> "ShardFiles":
        if rank.world_size == 1:
            return cls(output, errors_path(output))
        return cls(part_path(output, rank.rank, rank.world_size),
                   part_path(errors_path(output), rank.rank, rank.world_size))


def generate(args) -> int:
    rank = Rank.from_env()
    if rank.world_size > 1:
        _die_with_agent()
    base = sampling_params_from_args(args)
    engine_kwargs = engine_kwargs_from_args(args, rank)
    group = _gloo_group(args.rendezvous_timeout, args.dist_timeout) if rank.world_size > 1 else None
    files = ShardFiles.of(args.output, rank)
    with contextlib.ExitStack() as stack:
        locks = Locks("generate")
        stack.callback(locks.release)
        source, scan, done, failed = _agreed(group, lambda: _prepare(args, rank, files, locks, stack))
        skip = done if args.retry_errors else done | failed
        counts = _plan(scan.ids, rank, done, skip)
        llm = _load_llm(args.model, engine_kwargs) if counts.todo else None
        out = JsonlWriter(files.output, args.fsync_every, args.fsync_seconds).open()
        err = JsonlWriter(files.errors, args.fsync_every, args.fsync_seconds)
        try:
            if llm is not None:
                seed = engine_kwargs["seed"] if args.line_seeds else None
                items = read_shard(source, scan, rank, skip, llm.get_tokenizer(), base, seed, args.id_from_line)
                run(llm.llm_engine, items, out, err, counts, args.window, progress=args.progress and rank.rank == 0)
                with _engine_errors():
                    logger.info(llm.kv_stats().summary())
        finally:
            out.close()
            err.close()
        _say(f"rank {rank.rank}: " if rank.world_size > 1 else "", _summary(counts))
        if group is not None:
            if rank.rank != 0:
                locks.release()  # rank 0 takes this rank's part lock to merge the part
            _collective(group.barrier, "at the final barrier")  # every part is complete and closed
            if rank.rank != 0 or args.no_merge:
                return EXIT_FAILED_LINES if counts.failed or counts.skipped_errors else EXIT_OK
        return _exit_code(args.output, finalize(args.output, locks))


def _prepare(args, rank: Rank, files: ShardFiles, locks: Locks, stack: contextlib.ExitStack):
    """Every check that can fail on the user's paths, before the model loads: the output
    directory, the input (opened, spooled if need be, not one of the outputs, ids scanned),
    the locks, and the output files (writable, nanokv's; torn last lines repaired).
    Returns (source, scan, done keys, failed keys)."""
    output_dir = _check_output_path(args.output)
    source = open_input(args.input, output_dir, spool=rank.world_size == 1)
    stack.callback(source.f.close)
    _check_not_input(source, args.output)
    scan = _scan(source.f, source.name, args.allow_duplicate_ids, args.id_from_line)
    source.mark()
    for target in _lock_targets(args.output, rank):
        locks.take(target)
    merges = rank.rank == 0 and not (rank.world_size > 1 and args.no_merge)
    _check_writable({files.output, files.errors} | ({args.output, errors_path(args.output)} if merges else set()))
    done, failed = _resume_keys(args.output, files, locks)
    return source, scan, done, failed


def _check_output_path(output: str) -> str:
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise InputError(f"the directory of --output {output} does not exist: create {directory} first")
    if os.path.exists(output) and not os.path.isfile(output):
        kind = "a directory" if os.path.isdir(output) else "not a regular file"
        raise InputError(f"--output {output} is {kind}; give a file name")
    return directory


def _check_not_input(source: Source, output: str) -> None:
    for path, _, _ in _family(output):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == source.identity:
                raise InputError(f"--input {source.name} is {path}, which the run would write to; "
                                 "give another --output")


def _check_writable(paths) -> None:
    for path in sorted(paths):
        if os.path.exists(path):
            try:
                open(path, "ab").close()  # appends nothing: only asks the OS
            except OSError as e:
                raise InputError(f"cannot write {path}: {e.strerror}") from None


def _lock_targets(output: str, rank: Rank) -> list[str]:
    """What this process locks: the files it writes and those it will merge (and remove).
    One process: the output and every part on disk. Under torchrun: each rank its own
    part; rank 0 also the output and parts left by a run of another world size."""
    parts = sorted({target for _, _, target in _family(output)} - {output})
    if rank.world_size == 1:
        return [output, *parts]
    own = part_path(output, rank.rank, rank.world_size)
    if rank.rank:
        return [own]
    current = {part_path(output, r, rank.world_size) for r in range(rank.world_size)}
    return [output, own, *(p for p in parts if p not in current)]


def _agreed(group, prepare):
    """prepare() on every rank; under torchrun every rank then learns whether any failed,
    so that all stop with exit 2 together instead of some loading the model and waiting."""
    try:
        result = prepare()
    except (InputError, OSError):
        if group is not None:
            _failures(group, 1)
        raise
    if group is not None and _failures(group, 0):
        raise InputError("another rank failed its checks (its message says why); nothing was run")
    return result


def _failures(group, failed: int) -> int:
    import torch

    counts = torch.tensor([failed])
    _collective(lambda: group.allreduce([counts]), "while checking the paths")
    return int(counts.item())


def _collective(op, where: str) -> None:
    try:
        op().wait()
    except RuntimeError as e:  # gloo: a peer died, or the wait outlasted --dist-timeout
        raise RunFailed(f"lost the other ranks {where}: {_first_line(e)}") from None


def _plan(ids: list, rank: Rank, done: set[str], skip: set[str]) -> Counts:
    counts = Counts()
    for index, request_id in enumerate(ids):
        if request_id is _BLANK or not rank.owns(index):
            continue
        key = record_key(request_id, index + 1)
        if key in done:
            counts.skipped += 1
        elif key in skip:
            counts.skipped_errors += 1
        else:
            counts.todo += 1
    return counts


def _exit_code(output: str, num_errors: int) -> int:
    if num_errors:
        _say(f"{num_errors} lines failed; see {errors_path(output)}")
        return EXIT_FAILED_LINES
    return EXIT_OK


def _resume_keys(output: str, files: ShardFiles, locks: Locks) -> tuple[set[str], set[str]]:
    """Keys already in the outputs and in the errors files. Files under this process's
    locks must be nanokv's, and its own are repaired; files of other ranks are only read."""
    done: set[str] = set()
    failed: set[str] = set()
    for path, kind, target in _family(output):
        load_keys(path, kind, done if kind == RESULT else failed, mine=target in locks,
                  repair=path in (files.output, files.errors), evidence=locks.stale(target))
    locks.settle(files.output)
    return done, failed


def read_shard(source: Source, scan: Scan, rank: Rank, skip: set[str], tokenizer, base: SamplingParams,
               engine_seed: int | None, id_from_line: bool = False) -> Iterator[Item]:
    """This rank's lines not yet done, parsed lazily: memory holds one line at a time.
    Each line must still carry the id the scan saw (else InputError: the input changed, and
    its results would go under the wrong ids), and the file its size and mtime."""
    source.check_unchanged()
    source.f.seek(0)
    index = -1
    for index, raw in enumerate(source.f):
        if index >= len(scan.ids):
            break
        request_id = scan.ids[index]
        line = index + 1
        if not rank.owns(index) or (request_id is not _BLANK and record_key(request_id, line) in skip):
            continue
        now = _BLANK if not raw.strip() else _line_id(raw, line, id_from_line)
        carried = scan.renamed.get(index, request_id)
        if not (now is carried or (now not in (_BLANK, _MISSING, _NULL_ID) and carried is not _BLANK
                                   and json.dumps(now) == json.dumps(carried))):
            raise InputError(f"{source.name} changed during the run: line {line} now has id "
                             f"{_show_id(now)}, the id scan saw {_show_id(carried)}; nothing was written for it, "
                             "rerun on the final input to resume")
        if request_id is _BLANK:
            continue
        key = record_key(request_id, line)
        seed_for = None if engine_seed is None else (lambda: line_seed(engine_seed, key))
        try:
            prompt, params = parse_request(raw, tokenizer, base, seed_for)
        except Exception as e:
            # One line must never stop the job, and the tokenizer and chat template raise
            # more than ValueError on what they cannot take (a TypeError for a lone
            # surrogate in `messages`): whatever this line's parsing raises, it becomes the
            # line's error record. The engine is not involved yet, so nothing is hidden.
            yield Item(line, request_id, error=str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
        else:
            yield Item(line, request_id, prompt, params)
        source.check_unchanged()
    if index + 1 != len(scan.ids):
        raise InputError(f"{source.name} changed during the run: it has a different number of lines than "
                         "the id scan saw; rerun on the final input to resume")
    source.check_unchanged()


def _show_id(request_id) -> str:
    if request_id is _BLANK:
        return "none (a blank line)"
    if request_id is None:
        return "none (not a JSON object)"
    return "none" if request_id in (_MISSING, _NULL_ID) else json.dumps(request_id)


def run(engine, items: Iterator[Item], out: JsonlWriter, err: JsonlWriter, counts: Counts,
        window: int, progress: bool = False) -> None:
    """Keep up to `window` requests in the engine, topping up from `items` as requests
    finish; write each result when it finishes and flush after every step. A request the
    engine finished with an error (RequestOutput.error) goes to the errors file; a
    RuntimeError from the engine (a dead worker, a closed engine) raises RunFailed."""
    from tqdm.auto import tqdm

    pending: dict[str, Item] = {}
    exhausted = False
    start = time.perf_counter()
    last_postfix = 0.0
    # the bar counts lines handled; the postfix keeps generated and failed apart
    bar = tqdm(total=counts.todo, desc="Lines", unit="line", disable=not progress, dynamic_ncols=True)
    try:
        while True:
            failed_before = counts.failed
            while not exhausted and len(pending) < window:
                item = next(items, None)
                if item is None:
                    exhausted = True
                elif _submit(engine, item, pending, err, counts):
                    bar.update(1)
            if not pending:
                _postfix(bar, engine, counts, start, progress)
                break
            with _engine_errors():
                results = engine.step()
            for result in results:
                if result.finished and result.request_id in pending:
                    _finish(pending.pop(result.request_id), result, out, err, counts)
                    bar.update(1)
            out.flush()
            err.flush()
            now = time.perf_counter()
            if now - last_postfix > 0.5 or counts.failed != failed_before:
                last_postfix = now
                _postfix(bar, engine, counts, start, progress)
    finally:
        bar.close()
        for request_id in pending:  # interrupted: leave the engine clean (a dead one needs nothing)
            with contextlib.suppress(RuntimeError):
                engine.abort(request_id)


def _finish(item: Item, result, out: JsonlWriter, err: JsonlWriter, counts: Counts) -> None:
    error = getattr(result, "error", None)  # a request that failed alone inside a step
    if error is not None:
        err.write(error_record(item.request_id, item.line, error))
        counts.failed += 1
        return
    out.write(result_record(item.request_id, item.line, result, item.params))
    counts.done += 1
    counts.completion_tokens += sum(len(c.token_ids) for c in result.outputs)


def _postfix(bar, engine, counts: Counts, start: float, progress: bool) -> None:
    if not progress:
        return
    with _engine_errors():
        kv = engine.kv_stats()
    rate = counts.completion_tokens / max(time.perf_counter() - start, 1e-9)
    bar.set_postfix_str(f"{counts.done} generated, {counts.failed} failed, {rate:,.0f} tok/s, "
                        f"KV {kv.usage:.0%} (peak {kv.peak_used_blocks / kv.num_blocks:.0%})", refresh=False)


@contextlib.contextmanager
def _engine_errors():
    try:
        yield
    except RuntimeError as e:
        raise RunFailed(f"the engine failed: {_first_line(e)}; rerun the same command to resume") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _submit(engine, item: Item, pending: dict[str, Item], err: JsonlWriter, counts: Counts) -> bool:
    """Queue one item; True when it failed instead (recorded in the errors file)."""
    if item.error is None:
        try:
            with _engine_errors():
                request_id = engine.add_request(item.prompt, item.params, request_id=f"line-{item.line}")
        except ValueError as e:
            item.error = str(e)
        else:
            pending[request_id] = item
            return False
    err.write(error_record(item.request_id, item.line, item.error))
    counts.failed += 1
    return True


def _summary(counts: Counts) -> str:
    text = f"{counts.done} generated, {counts.failed} failed"
    if counts.skipped or counts.skipped_errors:
        text += f"; skipped {counts.skipped} already done and {counts.skipped_errors} recorded as errors"
    return text


def _load_llm(model: str, engine_kwargs: dict):
    from nanokv.llm import LLM

    if str(engine_kwargs["device"]).startswith("cuda:"):
        import torch

        torch.cuda.set_device(torch.device(engine_kwargs["device"]))
    try:
        with _engine_errors():
            return LLM(model, **engine_kwargs)
    except ValueError as e:  # a bad engine flag or model directory
        raise InputError(str(e)) from None


def _die_with_agent() -> None:
    """Under torchrun, die with the agent (PR_SET_PDEATHSIG, Linux): a killed agent must not
    leave ranks behind holding the model or waiting at a barrier for a day. The agent
    starts its workers from its main thread, which the signal is tied to."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the agent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _gloo_group(rendezvous_timeout_s: float, timeout_s: float):
    """A gloo group of the torchrun ranks, joined first thing (so a rank that cannot reach
    the others gives up after --rendezvous-timeout, not --dist-timeout), then given
    --dist-timeout for the collectives that wait on other ranks' work. Built from
    torchrun's env:// rendezvous but not registered as torch.distributed's default group,
    which stays free for the engine (tensor parallelism initialises its own)."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    short = timedelta(seconds=rendezvous_timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=short))
        prefix = f"nanokv-generate/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, short)
    except (RuntimeError, ValueError, KeyError) as e:  # DistStoreError is a RuntimeError
        raise RunFailed(f"rank {rank}: cannot rendezvous with the other ranks within --rendezvous-timeout "
                        f"{rendezvous_timeout_s:g}s: {_first_line(e)}") from None
    group._set_default_timeout(timedelta(seconds=timeout_s))  # private, but the only way to set it after the mesh is up
    return group


# ---- merge --------------------------------------------------------------------------

def finalize(output: str, locks: Locks) -> int:
    """Merge part files into `output` and the errors parts into its errors file, then
    remove the parts. Idempotent and crash safe: records whose id is already in the
    output are skipped, the output is fsynced before any part is removed, and an error
    whose id now has a result is dropped. Every file is locked and checked to be nanokv's
    before anything changes. Returns the number of error records left."""
    family = list(_family(output))
    for _, _, target in family:
        locks.take(target)
    done: set[str] = set()
    for path, kind, target in family:  # check all (raises on a file nanokv did not write)
        load_keys(path, kind, done if (kind, target) == (RESULT, output) else set(), mine=True,
                  repair=target == output, evidence=locks.stale(target))
    parts = [path for path, kind, target in family if kind == RESULT and target != output]
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
    for path, _, target in family:
        if target != output:
            os.remove(path)
    for _, _, target in family:
        locks.settle(target)
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
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".nanokv-errors-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.writelines(errors.values())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return len(errors)


def merge(args) -> int:
    _check_output_path(args.output)
    expected = {part_path(args.output, r, args.world_size) for r in range(args.world_size)}
    present = set(part_files(args.output))
    locks = Locks("merge")
    try:
        locks.take(args.output)
        num_errors = finalize(args.output, locks)
    finally:
        locks.release()
    if not present:
        _say(f"no part files of {args.output} to merge")
    elif expected - present:
        _say(f"warning: missing {', '.join(sorted(expected - present))}; merged the others "
             "(rerun the generate command to finish the missing shards)")
    return _exit_code(args.output, num_errors)


# ---- arguments ----------------------------------------------------------------------

def sampling_params_from_args(args) -> SamplingParams:
    try:
        return _sampling_params(args)
    except ValueError as e:
        raise InputError(f"bad sampling flag: {e}") from None


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output, logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, skip_special_tokens=not args.no_skip_special_tokens)


def engine_kwargs_from_args(args, rank: Rank) -> dict:
    if rank.world_size > 1 and args.tensor_parallel_size > 1:
        raise InputError("--tensor-parallel-size > 1 cannot be combined with torchrun data parallelism "
                         "(each process would need several devices); use one or the other")
    device = args.device
    if rank.world_size > 1 and device in ("auto", "cuda"):
        device = f"cuda:{rank.local_rank}" if _cuda_available() else "cpu"
    return dict(
        dtype=args.dtype, device=device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kvcache_block_size=args.kvcache_block_size,
        num_kvcache_blocks=args.num_kvcache_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager, seed=args.seed, attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanokv", description="nanokv command line")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline batch generation: JSONL in, JSONL out",
                         description="Generate for every line of a JSONL file; resumable; "
                                     "data parallel under torchrun.")
    io = gen.add_argument_group("input and output")
    io.add_argument("--model", required=True, help="Hugging Face model directory")
    io.add_argument("--input", required=True, help="JSONL, one request per line")
    io.add_argument("--output", required=True, help="JSONL results (errors go to <stem>.errors.jsonl)")
    io.add_argument("--window", type=_positive_int, default=1024,
                    help="most requests read but unfinished at a time (bounds memory)")
    io.add_argument("--fsync-every", type=_positive_int, default=256, help="fsync after this many records")
    io.add_argument("--fsync-seconds", type=float, default=10.0, help="... or after this many seconds")
    io.add_argument("--allow-duplicate-ids", action="store_true",
                    help='repeated ids become "<id>#<k>" for the k-th occurrence instead of an error')
    io.add_argument("--id-from-line", action="store_true", help="a line without an id gets its line number")
    io.add_argument("--retry-errors", action="store_true", help="retry lines recorded in the errors file")
    io.add_argument("--no-line-seeds", dest="line_seeds", action="store_false",
                    help="do not seed requests without a seed from (--seed, id): faster sampling, "
                         "but sampled output then depends on batching, resume and sharding")
    io.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    io.add_argument("--no-merge", action="store_true", help="under torchrun: leave the part files for `nanokv merge`")
    io.add_argument("--dist-timeout", type=float, default=86400.0,
                    help="under torchrun: seconds a rank waits for the others at the path checks and the final barrier")
    io.add_argument("--rendezvous-timeout", type=float, default=300.0,
                    help="under torchrun: seconds a rank waits at startup for the others to join")

    eng = gen.add_argument_group("engine (LLM(...) arguments)")
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--device", default="auto", help="auto/cpu/cuda; under torchrun cuda:LOCAL_RANK")
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--kvcache-block-size", type=int, default=16)
    eng.add_argument("--num-kvcache-blocks", type=int, default=None)
    eng.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--enforce-eager", action="store_true")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--attention-backend", default="auto")
    eng.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="shard the model over N devices (not with torchrun data parallelism)")

    d = SamplingParams()
    smp = gen.add_argument_group("sampling (SamplingParams defaults; a line's \"sampling_params\" overrides)")
    smp.add_argument("--n", type=int, default=d.n)
    smp.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    smp.add_argument("--top-p", type=float, default=d.top_p)
    smp.add_argument("--top-k", type=int, default=d.top_k)
    smp.add_argument("--min-p", type=float, default=d.min_p)
    smp.add_argument("--sampling-seed", type=int, default=None, help="SamplingParams.seed for every line")
    smp.add_argument("--max-tokens", type=int, default=d.max_tokens)
    smp.add_argument("--min-tokens", type=int, default=d.min_tokens)
    smp.add_argument("--ignore-eos", action="store_true")
    smp.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    smp.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    smp.add_argument("--include-stop-str-in-output", action="store_true")
    smp.add_argument("--logprobs", type=int, default=None)
    smp.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    smp.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    smp.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    smp.add_argument("--no-skip-special-tokens", action="store_true")

    mrg = sub.add_parser("merge", help="merge the part files of a torchrun generate run",
                         description="Append <output>.part-* to the output (skipping ids already "
                                     "there), merge the errors parts, remove the parts.")
    mrg.add_argument("--output", required=True)
    mrg.add_argument("--world-size", type=_positive_int, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return generate(args) if args.command == "generate" else merge(args)
    except (InputError, OSError, RunFailed) as e:  # bad ids, flags, model or paths; a failed engine or rank
        _say(f"nanokv {args.command}: error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted; rerun the same command to resume")
        return 130


def _say(*parts: str) -> None:
    print("".join(parts), file=sys.stderr, flush=True)
