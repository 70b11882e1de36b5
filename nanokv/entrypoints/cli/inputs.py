"""The input file: opened once (a pipe is spooled first), its ids scanned before any
work, its lines read lazily and checked against the scan, parsed into requests."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from nanokv.entrypoints.cli.common import InputError, Rank, valid_id
from nanokv.entrypoints.cli.records import record_key
from nanokv.sampling_params import SamplingParams, StructuredOutputsParams


BLANK = object()  # a blank input line: skipped, not a request


_MISSING = object()  # a JSON object without "id"


_NULL_ID = object()  # "id": null, which is no id


_PROMPT_FORMS = ("prompt", "messages", "prompt_token_ids")


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


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
    None where the line is no JSON object, BLANK for blank lines; and the id each renamed
    line (--allow-duplicate-ids) carries itself."""

    ids: list
    renamed: dict[int, object]


def scan_ids(path: str, *, allow_duplicate_ids: bool = False, id_from_line: bool = False) -> list:
    """One pass over the input keeping only ids (see Scan). Raises InputError naming the
    lines of duplicate, missing or malformed ids.

    allow_duplicate_ids: the k-th occurrence (k >= 2) of an id becomes "<id>#<k>".
    id_from_line: a line without "id" gets its line number (an int) as id."""
    with open(path, "rb") as f:
        return scan_file(f, path, allow_duplicate_ids, id_from_line).ids


def scan_file(f: BinaryIO, name: str, allow_duplicate_ids: bool, id_from_line: bool) -> Scan:
    scan = Scan([], {})
    first_line: dict[str, int] = {}
    occurrences: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    missing: list[int] = []
    malformed: list[str] = []
    for line, raw in enumerate(f, 1):
        if not raw.strip():
            scan.ids.append(BLANK)
            continue
        request_id = _line_id(raw, line, id_from_line)
        if request_id is _MISSING:
            missing.append(line)
            request_id = None
        elif request_id is not None and not valid_id(request_id):
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
    spec = _line_structured_outputs(obj)
    if spec is not None:
        if params.structured_outputs is not None and "structured_outputs" in (obj.get("sampling_params") or {}):
            raise ValueError("give one structured-output constraint per line, got sampling_params.structured_outputs "
                             "and a top-level one")
        params = dataclasses.replace(params, structured_outputs=spec)
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


def _line_structured_outputs(obj: dict) -> StructuredOutputsParams | None:
    """The line's top-level response_format or structured_outputs, as the server reads them
    from a request body (one of the two; response_format text is no constraint)."""
    given = [k for k in ("response_format", "structured_outputs") if obj.get(k) is not None]
    if len(given) > 1:
        raise ValueError("give one structured-output constraint per line, got response_format and "
                         "structured_outputs")
    if not given:
        return None
    if given[0] == "response_format":
        return StructuredOutputsParams.from_response_format(obj["response_format"])
    return StructuredOutputsParams.of(obj["structured_outputs"])


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
        if not rank.owns(index) or (request_id is not BLANK and record_key(request_id, line) in skip):
            continue
        now = BLANK if not raw.strip() else _line_id(raw, line, id_from_line)
        carried = scan.renamed.get(index, request_id)
        if not (now is carried or (now not in (BLANK, _MISSING, _NULL_ID) and carried is not BLANK
                                   and json.dumps(now) == json.dumps(carried))):
            raise InputError(f"{source.name} changed during the run: line {line} now has id "
                             f"{_show_id(now)}, the id scan saw {_show_id(carried)}; nothing was written for it, "
                             "rerun on the final input to resume")
        if request_id is BLANK:
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
    if request_id is BLANK:
        return "none (a blank line)"
    if request_id is None:
        return "none (not a JSON object)"
    return "none" if request_id in (_MISSING, _NULL_ID) else json.dumps(request_id)
