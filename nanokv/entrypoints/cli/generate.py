"""`nanokv generate`: offline batch generation, JSONL in, JSONL out, one record per input
line written as soon as it finishes; resumable, and data parallel under torchrun (rank r
takes the input lines whose 0-based index is r modulo the world size, writes its own part
files, and rank 0 merges them at the end).

Every check that can fail on the user's paths runs before the model loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from nanokv.entrypoints.cli.arguments import engine_args_from_cli, sampling_params_from_args
from nanokv.entrypoints.cli.common import EXIT_FAILED_LINES, EXIT_OK, InputError, Rank, RunFailed, first_line, logger, say
from nanokv.entrypoints.cli.inputs import BLANK, Item, Source, open_input, read_shard, scan_file
from nanokv.entrypoints.cli.locks import Locks
from nanokv.entrypoints.cli.merge import finalize
from nanokv.entrypoints.cli.records import (
    RESULT, JsonlWriter, check_output_path, error_record, errors_path, exit_code, family, load_keys, part_path,
    record_key, result_record)


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
    base = sampling_params_from_args(args)  # the flags checked now; the model's defaults join once it loads
    engine_args = engine_args_from_cli(args, rank)
    group = _gloo_group(args.rendezvous_timeout, args.dist_timeout) if rank.world_size > 1 else None
    files = ShardFiles.of(args.output, rank)
    with contextlib.ExitStack() as stack:
        locks = Locks("generate", args.output)
        stack.callback(locks.release)
        source, scan, done, failed = _agreed(group, lambda: _prepare(args, rank, files, locks, stack))
        skip = done if args.retry_errors else done | failed
        counts = _plan(scan.ids, rank, done, skip)
        llm = _load_llm(engine_args) if counts.todo else None
        out = JsonlWriter(files.output, args.fsync_every, args.fsync_seconds).open()
        err = JsonlWriter(files.errors, args.fsync_every, args.fsync_seconds)
        try:
            if llm is not None:
                base = sampling_params_from_args(args, llm.llm_engine.config.default_sampling_params)
                seed = llm.llm_engine.config.seed if args.line_seeds else None
                items = read_shard(source, scan, rank, skip, llm.get_tokenizer(), base, seed, args.id_from_line)
                run(llm.llm_engine, items, out, err, counts, args.window, progress=args.progress and rank.rank == 0)
                if not llm.llm_engine.config.disable_log_stats:
                    with _engine_errors():
                        logger.info(llm.kv_stats().summary())
        finally:
            try:
                out.close()
            finally:
                err.close()
        say(f"rank {rank.rank}: " if rank.world_size > 1 else "", _summary(counts))
        if group is not None:
            if rank.rank != 0:
                locks.release()  # rank 0 takes this rank's part lock to merge the part
            _collective(group.barrier, "at the final barrier")  # every part is complete and closed
            if rank.rank != 0 or args.no_merge:
                return EXIT_FAILED_LINES if counts.failed or counts.skipped_errors else EXIT_OK
        return exit_code(args.output, finalize(args.output, locks))


def _prepare(args, rank: Rank, files: ShardFiles, locks: Locks, stack: contextlib.ExitStack):
    """Every check that can fail on the user's paths, before the model loads: the output
    directory, the input (opened, spooled if need be, not one of the outputs, ids scanned),
    the locks, and the output files (writable, nanokv's; torn last lines repaired).
    Returns (source, scan, done keys, failed keys)."""
    output_dir = check_output_path(args.output)
    source = open_input(args.input, output_dir, spool=rank.world_size == 1)
    stack.callback(source.f.close)
    _check_not_input(source, args.output)
    scan = scan_file(source.f, source.name, args.allow_duplicate_ids, args.id_from_line)
    source.mark()
    for target in _lock_targets(args.output, rank):
        locks.take(target)
    merges = rank.rank == 0 and not (rank.world_size > 1 and args.no_merge)
    _check_writable({files.output, files.errors} | ({args.output, errors_path(args.output)} if merges else set()))
    done, failed = _resume_keys(args.output, files, locks)
    return source, scan, done, failed


def _check_not_input(source: Source, output: str) -> None:
    for path, _, _ in family(output):
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
    parts = sorted({target for _, _, target in family(output)} - {output})
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
        raise RunFailed(f"lost the other ranks {where}: {first_line(e)}") from None


def _plan(ids: list, rank: Rank, done: set[str], skip: set[str]) -> Counts:
    counts = Counts()
    for index, request_id in enumerate(ids):
        if request_id is BLANK or not rank.owns(index):
            continue
        key = record_key(request_id, index + 1)
        if key in done:
            counts.skipped += 1
        elif key in skip:
            counts.skipped_errors += 1
        else:
            counts.todo += 1
    return counts


def _resume_keys(output: str, files: ShardFiles, locks: Locks) -> tuple[set[str], set[str]]:
    """Keys already in the outputs and in the errors files. Files under this process's
    locks must be nanokv's, and its own are repaired; files of other ranks are only read."""
    done: set[str] = set()
    failed: set[str] = set()
    for path, kind, target in family(output):
        load_keys(path, kind, done if kind == RESULT else failed, mine=target in locks,
                  repair=path in (files.output, files.errors), evidence=locks.stale(target))
    locks.settle(files.output)
    return done, failed


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
        raise RunFailed(f"the engine failed: {first_line(e)}; rerun the same command to resume") from e


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


def _load_llm(engine_args):
    from nanokv.llm import LLM

    if str(engine_args.device).startswith("cuda:"):
        import torch

        torch.cuda.set_device(torch.device(engine_args.device))
    try:
        with _engine_errors():
            return LLM(**dataclasses.asdict(engine_args))
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
                        f"{rendezvous_timeout_s:g}s: {first_line(e)}") from None
    group._set_default_timeout(timedelta(seconds=timeout_s))  # private, but the only way to set it after the mesh is up
    return group
