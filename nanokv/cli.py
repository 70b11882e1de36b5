"""The nanokv command line.

    nanokv generate --model DIR --input prompts.jsonl --output out.jsonl [flags]
    nanokv merge --output out.jsonl --world-size N

`generate` is offline batch generation: JSONL in, JSONL out, one record per input line
written as soon as it finishes. It is resumable (records already in the output, or in the
errors file, are not redone; a torn last line is cut off and redone) and data parallel
under torchrun (rank r takes the input lines whose 0-based index is r modulo the world
size, writes its own part files, and rank 0 merges them at the end). The README's
"Batch generation CLI" section documents the schemas, resume rules and exit codes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from nanokv.sampling_params import SamplingParams

EXIT_OK = 0
EXIT_USAGE = 2  # bad flags or input ids, unreadable files, a model that does not load
EXIT_FAILED_LINES = 3  # the job ran, but some lines are in the errors file

logger = logging.getLogger("nanokv")

_BLANK = object()  # a blank input line: skipped, not a request
_MISSING = object()  # a JSON object without "id"
_PROMPT_FORMS = ("prompt", "messages", "prompt_token_ids")
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class InputError(ValueError):
    """The input as a whole is unusable (duplicate or missing ids): nothing runs."""


# ---- file names ---------------------------------------------------------------------

def errors_path(output: str) -> str:
    """out.jsonl -> out.errors.jsonl; any other name gets .errors.jsonl appended."""
    stem = output[:-len(".jsonl")] if output.endswith(".jsonl") else output
    return stem + ".errors.jsonl"


def part_path(path: str, rank: int, world_size: int) -> str:
    return f"{path}.part-{rank:05d}-of-{world_size:05d}"


def part_files(path: str) -> list[str]:
    """Every part of `path` on disk, whatever world size wrote it, in name (rank) order."""
    return sorted(glob.glob(glob.escape(path) + ".part-[0-9]*-of-[0-9]*"))


# ---- records ------------------------------------------------------------------------

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


def iter_records(path: str) -> Iterator[tuple[int, bytes, dict]]:
    """(end offset, raw line, record) of each complete record of a JSONL file this tool
    wrote, up to the first torn or corrupt line (no newline, bad JSON, no id/line)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        end = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            try:
                rec = json.loads(raw)
            except ValueError:
                return
            if not isinstance(rec, dict) or "id" not in rec or "line" not in rec:
                return
            end += len(raw)
            yield end, raw, rec


def load_keys(path: str, keys: set[str], *, repair: bool) -> int:
    """Add the keys of `path`'s records to `keys`; returns how many. With repair, cut the
    file after its last complete record (a write torn by a kill) so appends start clean."""
    count = good_end = 0
    for good_end, _, rec in iter_records(path):
        keys.add(record_key(rec["id"], rec["line"]))
        count += 1
    if repair and os.path.exists(path) and os.path.getsize(path) > good_end:
        torn = os.path.getsize(path) - good_end
        with open(path, "r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
        _say(f"{path}: removed a torn or corrupt tail of {torn} bytes; those requests are redone")
    return count


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

def scan_ids(path: str, *, allow_duplicate_ids: bool = False, id_from_line: bool = False) -> list:
    """One pass over the input keeping only ids: the request id of each line (index =
    line number - 1), None where the line is no JSON object (it becomes an error record),
    _BLANK for blank lines. Raises InputError naming the lines of duplicate, missing or
    malformed ids.

    allow_duplicate_ids: the k-th occurrence (k >= 2) of an id becomes "<id>#<k>".
    id_from_line: a line without "id" gets its line number (an int) as id."""
    ids: list = []
    first_line: dict[str, int] = {}
    occurrences: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    missing: list[int] = []
    malformed: list[str] = []
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            if not raw.strip():
                ids.append(_BLANK)
                continue
            request_id = _line_id(raw, line, id_from_line)
            if request_id is _MISSING:
                missing.append(line)
                request_id = None
            elif request_id is not None and not _valid_id(request_id):
                malformed.append(f"line {line}: {request_id!r}")
                request_id = None
            if request_id is not None:
                key = record_key(request_id, line)
                if allow_duplicate_ids:
                    k = occurrences[key] = occurrences.get(key, 0) + 1
                    if k > 1:
                        request_id = f"{request_id}#{k}"
                        key = record_key(request_id, line)
                if key in first_line:
                    duplicates.setdefault(key, [first_line[key]]).append(line)
                else:
                    first_line[key] = line
            ids.append(request_id)
    _raise_id_problems(path, duplicates, missing, malformed, allow_duplicate_ids)
    return ids


def _line_id(raw: bytes, line: int, id_from_line: bool):
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if "id" in obj:
        return obj["id"]
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
        raise InputError(f"{path}: " + "\n".join(problems) + "\nnothing was run")


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
    except ValueError as e:
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
    base = sampling_params_from_args(args)
    engine_kwargs = engine_kwargs_from_args(args, rank)
    ids = scan_ids(args.input, allow_duplicate_ids=args.allow_duplicate_ids, id_from_line=args.id_from_line)
    files = ShardFiles.of(args.output, rank)
    done, failed = _resume_keys(args.output, files)
    skip = done if args.retry_errors else done | failed
    counts = _plan(ids, rank, done, skip)
    llm = _load_llm(args.model, engine_kwargs) if counts.todo else None
    group = _gloo_group(args.dist_timeout) if rank.world_size > 1 else None
    out = JsonlWriter(files.output, args.fsync_every, args.fsync_seconds).open()
    err = JsonlWriter(files.errors, args.fsync_every, args.fsync_seconds)
    try:
        if llm is not None:
            seed = engine_kwargs["seed"] if args.line_seeds else None
            items = read_shard(args.input, ids, rank, skip, llm.get_tokenizer(), base, seed)
            run(llm.llm_engine, items, out, err, counts, args.window, progress=args.progress and rank.rank == 0)
            logger.info(llm.kv_stats().summary())
    finally:
        out.close()
        err.close()
    _say(f"rank {rank.rank}: " if rank.world_size > 1 else "", _summary(counts))
    if group is not None:
        group.barrier().wait()  # every part is complete and closed
        if rank.rank != 0 or args.no_merge:
            return EXIT_FAILED_LINES if counts.failed or counts.skipped_errors else EXIT_OK
    return _exit_code(args.output, finalize(args.output))


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


def _resume_keys(output: str, files: ShardFiles) -> tuple[set[str], set[str]]:
    """Keys already in the outputs and in the errors files. This process's own files are
    repaired; the merged output and parts left by runs of other world sizes are only read."""
    done: set[str] = set()
    failed: set[str] = set()
    for path in {output, *part_files(output)} - {files.output}:
        load_keys(path, done, repair=False)
    load_keys(files.output, done, repair=True)
    errors = errors_path(output)
    for path in {errors, *part_files(errors)} - {files.errors}:
        load_keys(path, failed, repair=False)
    load_keys(files.errors, failed, repair=True)
    return done, failed


def read_shard(path: str, ids: list, rank: Rank, skip: set[str], tokenizer, base: SamplingParams,
               engine_seed: int | None) -> Iterator[Item]:
    """This rank's lines not yet done, parsed lazily: memory holds one line at a time."""
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            request_id = ids[index] if index < len(ids) else _BLANK  # the file grew since the scan
            if request_id is _BLANK or not rank.owns(index):
                continue
            line = index + 1
            key = record_key(request_id, line)
            if key in skip:
                continue
            seed_for = None if engine_seed is None else (lambda: line_seed(engine_seed, key))
            try:
                prompt, params = parse_request(raw, tokenizer, base, seed_for)
            except ValueError as e:
                yield Item(line, request_id, error=str(e))
                continue
            yield Item(line, request_id, prompt, params)


def run(engine, items: Iterator[Item], out: JsonlWriter, err: JsonlWriter, counts: Counts,
        window: int, progress: bool = False) -> None:
    """Keep up to `window` requests in the engine, topping up from `items` as requests
    finish; write each result when it finishes and flush after every step."""
    from tqdm.auto import tqdm

    pending: dict[str, Item] = {}
    exhausted = False
    start = time.perf_counter()
    last_postfix = 0.0
    bar = tqdm(total=counts.todo, desc="Generated", unit="req", disable=not progress, dynamic_ncols=True)
    try:
        while True:
            while not exhausted and len(pending) < window:
                item = next(items, None)
                if item is None:
                    exhausted = True
                elif _submit(engine, item, pending, err, counts):
                    bar.update(1)
            if not pending:
                break
            for result in engine.step():
                if result.finished and result.request_id in pending:
                    item = pending.pop(result.request_id)
                    out.write(result_record(item.request_id, item.line, result, item.params))
                    counts.done += 1
                    counts.completion_tokens += sum(len(c.token_ids) for c in result.outputs)
                    bar.update(1)
            out.flush()
            err.flush()
            now = time.perf_counter()
            if progress and (now - last_postfix > 0.5 or not pending):
                last_postfix = now
                kv = engine.kv_stats()
                bar.set_postfix_str(f"{counts.completion_tokens / (now - start):,.0f} tok/s, KV {kv.usage:.0%} "
                                    f"(peak {kv.peak_used_blocks / kv.num_blocks:.0%}), failed {counts.failed}",
                                    refresh=False)
    finally:
        bar.close()
        for request_id in pending:  # interrupted: leave the engine clean
            engine.abort(request_id)


def _submit(engine, item: Item, pending: dict[str, Item], err: JsonlWriter, counts: Counts) -> bool:
    """Queue one item; True when it failed instead (recorded in the errors file)."""
    if item.error is None:
        try:
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
        return LLM(model, **engine_kwargs)
    except ValueError as e:  # a bad engine flag or model directory
        raise InputError(str(e)) from None


def _gloo_group(timeout_s: float):
    """A gloo group of the torchrun ranks, for the final barrier. Built from torchrun's
    env:// rendezvous but not registered as torch.distributed's default group, which stays
    free for the engine (tensor parallelism initialises its own)."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=timeout))
    prefix = f"nanokv-generate/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


# ---- merge --------------------------------------------------------------------------

def finalize(output: str) -> int:
    """Merge part files into `output` and the errors parts into its errors file, then
    remove the parts. Idempotent and crash safe: records whose id is already in the
    output are skipped, the output is fsynced before any part is removed, and an error
    whose id now has a result is dropped. Returns the number of error records left."""
    parts = part_files(output)
    done: set[str] = set()
    load_keys(output, done, repair=True)
    with open(output, "ab") as f:
        for part in parts:
            for _, raw, rec in iter_records(part):
                key = record_key(rec["id"], rec["line"])
                if key not in done:
                    f.write(raw)
                    done.add(key)
        f.flush()
        os.fsync(f.fileno())
    num_errors = _merge_errors(errors_path(output), done)
    for part in parts + part_files(errors_path(output)):
        os.remove(part)
    return num_errors


def _merge_errors(path: str, done: set[str]) -> int:
    errors: dict[str, bytes] = {}  # key -> latest record; errors are few
    for source in [path, *part_files(path)]:
        for _, raw, rec in iter_records(source):
            key = record_key(rec["id"], rec["line"])
            if key not in done:
                errors.pop(key, None)
                errors[key] = raw
    if not errors:
        if os.path.exists(path):
            os.remove(path)
        return 0
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(errors.values())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(errors)


def merge(args) -> int:
    expected = {part_path(args.output, r, args.world_size) for r in range(args.world_size)}
    present = set(part_files(args.output))
    if not present:
        _say(f"no part files of {args.output} to merge")
    elif expected - present:
        _say(f"warning: missing {', '.join(sorted(expected - present))}; merging the others "
             "(rerun the generate command to finish the missing shards)")
    return _exit_code(args.output, finalize(args.output))


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
    io.add_argument("--model", required=True,
                    help="Hugging Face model directory, .gguf file or built-in name (smollm2)")
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
                    help="seconds rank 0 waits at the final barrier for the other ranks")

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
    except (InputError, OSError) as e:  # bad ids, flags or model; unreadable or unwritable files
        _say(f"nanokv {args.command}: error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted; rerun the same command to resume")
        return 130


def _say(*parts: str) -> None:
    print("".join(parts), file=sys.stderr, flush=True)
