"""Building the C kernels: the compiler, the cache directory and the key a build is cached under.

The kernels' sources are the files of csrc/ (one .c file per topic behind small shared
headers; csrc/common.h lists them), compiled together by the machine's C compiler (`cc -O3
-march=native -pthread`) into one shared library, in a cache directory keyed by every
source and header file's bytes, the flags, the compiler and the CPU, the way Triton caches
its kernels. An entry is trusted only when its bytes match the manifest written beside it
at build time (its name, size and sha256); anything else is built again (see build()), and
ffi loads the checked bytes themselves.

Variants (each built and cached on its own): the vector width, 16 floats where the compiler
targets AVX-512 and 8 otherwise unless NANOKV_CPU_WIDTH (or `width`) forces 8 or 16, so
that both widths build and are tested on any x86-64; and `portable`, which leaves out the
int8 kernels' intrinsics (AVX2, VNNI) for their plain-C path, optionally with the VNNI
paths' unsigned-offset arithmetic (tests compare them all).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from nanokv.fileio import write_durably

logger = logging.getLogger("nanokv")

CSRC = Path(__file__).with_name("csrc")  # the kernels' C sources and headers


def sources() -> list[Path]:
    """Every file the library is built from: csrc's .c files (compiled) and .h files
    (included), in name order."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


FLAGS = ["-O3", "-march=native", "-pthread", "-fPIC", "-shared", "-std=gnu11"]


WIDTHS = (8, 16)


def width() -> int | None:
    """NANOKV_CPU_WIDTH: 8 or 16 forces the vector width (floats); unset, empty or 'native':
    the compiler's choice for this CPU. Read on every call."""
    value = os.environ.get("NANOKV_CPU_WIDTH", "").strip()
    if value in ("", "native"):
        return None
    if value not in {str(w) for w in WIDTHS}:
        raise ValueError(f"NANOKV_CPU_WIDTH={value!r}: use 8, 16 or native")
    return int(value)


PORTABLE = {False: [], True: ["-DNK_PORTABLE"], "offset": ["-DNK_PORTABLE", "-DNK_INT8_OFFSET"]}


def flags(width: int | None = None, portable: bool | str = False) -> list[str]:
    """The compiler flags of one variant. portable=True: the int8 kernels' plain-C path;
    "offset": the same with the VNNI paths' arithmetic (activations + 128, column sums off)."""
    if width is not None and width not in WIDTHS:
        raise ValueError(f"vector width {width}: use one of {WIDTHS}")
    extra = [f"-DNK_WIDTH={width}"] if width is not None else []
    return FLAGS + extra + PORTABLE[portable] + ["-Wno-psabi"]


def switched_off() -> bool:
    """NANOKV_CPU_KERNELS=0: the torch path everywhere, nothing built."""
    return os.environ.get("NANOKV_CPU_KERNELS", "1") == "0"


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH; None when there is none (looked up, not run)."""
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else shutil.which("cc") or shutil.which("gcc")


def can_build() -> bool:
    """Switched on and a compiler at hand: what choosing the kernels may rely on before
    building them. Compiles nothing; ffi.available() is the build itself."""
    return not switched_off() and compiler() is not None


def cache_root() -> Path:
    """nanokv's cache: $NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv or ~/.cache/nanokv
    (the kernels are built into its `kernels` folder, gguf.py keeps its `gguf` folder)."""
    return Path(os.environ.get("NANOKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanokv"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _key(cc: str, flags: list[str]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for path in sources():  # each file's name and bytes, each part length-prefixed: no two trees alike
        for part in (path.name.encode(), path.read_bytes()):
            key.update(len(part).to_bytes(8, "little") + part)
    for part in (" ".join(flags), version, _cpu_signature(), platform.machine()):
        key.update(len(part.encode()).to_bytes(8, "little") + part.encode())
    return key.hexdigest()[:16]


@dataclass(frozen=True)
class Built:
    """One variant's library: where its cache entry lies and its bytes, read once and
    checked against the entry's manifest (ffi loads these bytes, not the file again)."""

    path: Path
    data: bytes


BUILD_TIMEOUT_S = 600  # the most a compile may take, and a builder waits for another's


def build(width: int | None = None, portable: bool | str = False) -> Built:
    """The shared library of one variant (see flags), compiled first unless the cache holds
    an entry whose bytes match its manifest.

    An entry is `nanokv_cpu_<key>.so` and its manifest `nanokv_cpu_<key>.json` (name, size and
    sha256); the manifest is the commit point: it is written (fsync, rename, fsync of the
    folder) only after the library is durable under its own name, and an entry is trusted
    only when the library's bytes match it. So a crash between the steps, a truncated or
    changed library, a missing or damaged manifest each read as no entry and are built
    again, replacing the entry by rename. Builders of one key take turns on a lock file
    (torchrun ranks: one compiles, the others load what it committed). A cache that cannot
    be written to builds into a private temporary folder, removed at exit. A build begun
    by start_build is waited for (its library, or its error), not begun again."""
    with _started_lock:
        started = _started.pop(_started_key(width, portable), None)
    if started is not None:
        return started.result(timeout=BUILD_TIMEOUT_S)
    return _build_variant(width, portable)


_started: dict[tuple, Future] = {}  # _started_key -> the build start_build began
_started_lock = threading.Lock()
# a forked child has no build thread: it builds (or finds the entry) itself
os.register_at_fork(after_in_child=_started.clear)


def _started_key(width: int | None, portable: bool | str) -> tuple:
    """A begun build is of one variant, compiler and cache folder."""
    return width, portable, compiler(), str(cache_dir())


def start_build(width: int | None = None, portable: bool | str = False) -> None:
    """Begin building a variant (or checking its cache entry) in a background thread, so that
    on a first start the compiler runs while the model's config and tokenizer load; the
    next build() of the variant waits for it. Nothing when the kernels are switched off,
    there is no compiler, or it was begun already."""
    if not can_build():
        return
    future, key = Future(), _started_key(width, portable)
    with _started_lock:
        if key in _started:
            return
        _started[key] = future

    def run():
        try:
            future.set_result(_build_variant(width, portable))
        except BaseException as e:  # noqa: BLE001 - handed to the build() that waits for it
            future.set_exception(e)

    threading.Thread(target=run, name="nanokv-kernel-build", daemon=True).start()


def _build_variant(width: int | None, portable: bool | str) -> Built:
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    variant = flags(width, portable)
    name = f"nanokv_cpu_{_key(cc, variant)}"
    folder = cache_dir()
    found = _verified(folder, name)
    if found is not None:
        return found
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{name}.lock", "a")
    except OSError as e:
        folder = _private_folder(e)
        return _verified(folder, name, quiet=True) or _build(cc, variant, folder, name)
    with lock:
        _lock(lock)
        return _verified(folder, name, quiet=True) or _build(cc, variant, folder, name)


def _verified(folder: Path, name: str, quiet: bool = False) -> Built | None:
    """The entry's library if its bytes match its manifest; None (and a log line, unless
    quiet or there is no entry at all) otherwise."""
    library, manifest = folder / f"{name}.so", folder / f"{name}.json"
    try:
        data = _read_regular(library, MAX_LIBRARY_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        problem = f"unreadable ({e})"
    else:
        try:
            expected = json.loads(_read_regular(manifest, MAX_MANIFEST_BYTES))
            problem = None if expected == _manifest(name, data) else "does not match its manifest"
        except FileNotFoundError:
            problem = "has no manifest"
        except (OSError, ValueError) as e:
            problem = f"has an unreadable manifest ({e})"
        if problem is None:
            return Built(library, data)
    if not quiet:
        logger.warning("nanokv CPU kernels: cached %s %s; building it again", library, problem)
    return None


MAX_LIBRARY_BYTES = 64 << 20  # far above any build of the kernels (about 0.3 MB); more is no library of ours
MAX_MANIFEST_BYTES = 4096


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes (a symlink to one is followed); OSError for anything else (a
    folder, a device such as /dev/zero, a FIFO: opened without blocking, never read) and
    for a file over `limit` bytes, so a cache entry cannot make the check read forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with open(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"over {limit} bytes", str(path))
    return data


def _manifest(name: str, data: bytes) -> dict:
    """What an entry's library must be: its entry's name (an entry copied from another
    variant's, library and manifest, is no match), its size and its sha256."""
    return {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _build(cc: str, variant: list[str], folder: Path, name: str) -> Built:
    """Compile into a temporary folder beside the entry, then commit it (a commit that
    fails, say on a file where the manifest goes, commits to the private folder instead)."""
    try:
        workspace = tempfile.TemporaryDirectory(dir=folder, prefix=f".{name}-")
    except OSError as e:  # a folder that takes no new files (read-only, immutable) though its lock opened
        if folder == _private:
            raise
        return _build(cc, variant, _private_folder(e), name)
    with workspace as tmp:
        out = Path(tmp) / f"{name}.so"
        data = _compile(cc, variant, Path(tmp), out)
    try:
        built = _commit(folder, name, data)
    except OSError as e:
        if folder == _private:
            raise
        built = _commit(_private_folder(e), name, data)
    logger.info("built nanokv CPU kernels: %s", built.path)
    return built


def build_jobs() -> int:
    """How many compilers run at once: one per CPU this process may use (the sources are a
    few files of unequal size, so more would not help)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_running: set[subprocess.Popen] = set()  # compilers in flight, stopped if the process exits first


def _compile(cc: str, variant: list[str], tmp: Path, out: Path, jobs: int | None = None) -> bytes:
    """The library's bytes: each .c file compiled to an object on its own (up to `jobs` at
    once, the largest first), then linked with the same flags. The same library, byte for
    byte, as one `cc <flags> *.c` (which compiles each file on its own too), in less time
    when there are cores to spare."""
    compiled = sorted((p for p in sources() if p.suffix == ".c"), key=lambda p: -p.stat().st_size)
    pending = [(p, tmp / f"{p.stem}.o") for p in compiled]
    jobs, procs, failed = jobs or build_jobs(), [], None
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        while (pending or procs) and failed is None:
            while pending and len(procs) < jobs:
                if _exiting:
                    raise RuntimeError("the process is exiting")
                src, obj = pending.pop(0)
                with open(obj.with_suffix(".err"), "wb") as err:  # a file: a full pipe would stall the compiler
                    proc = subprocess.Popen([cc, *variant, "-c", str(src), "-o", str(obj)],
                                            stdout=subprocess.DEVNULL, stderr=err)
                _running.add(proc)
                procs.append(proc)
            done = next((proc for proc in procs if proc.poll() is not None), None)
            if done is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(procs[0].args, BUILD_TIMEOUT_S)
                time.sleep(0.01)
                continue
            procs.remove(done)
            _running.discard(done)
            if done.returncode != 0:
                failed = Path(done.args[-1]).with_suffix(".err").read_text(errors="replace")
    finally:
        for proc in procs:  # a failure or a timeout: the others are not waited for
            proc.kill()
            proc.wait()
            _running.discard(proc)
    if failed is None:
        objects = [str(tmp / f"{p.stem}.o") for p in sorted(compiled)]  # linked in name order, as cc *.c does
        link = subprocess.run([cc, *variant, *objects, "-o", str(out), "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        failed = link.stderr if link.returncode != 0 else None
    if failed is not None:
        raise RuntimeError(f"{cc} failed to build the CPU kernels ({CSRC}):\n{failed[-2000:]}")
    return out.read_bytes()


_exiting = False


@atexit.register
def _stop_compilers() -> None:
    """A background build still compiling at exit: its compilers are stopped, no new one
    starts (its temporary folder goes with TemporaryDirectory's finaliser or stays, unused)."""
    global _exiting
    _exiting = True
    for proc in list(_running):
        proc.kill()


def _commit(folder: Path, name: str, data: bytes) -> Built:
    """The library, then its manifest (the commit point), each written whole and durable
    before it takes its name."""
    library = folder / f"{name}.so"
    write_durably(library, [data], 0o755)
    write_durably(folder / f"{name}.json", [json.dumps(_manifest(name, data)).encode()])
    return Built(library, data)



def _lock(f) -> None:
    """Wait (at most BUILD_TIMEOUT_S) for the other builders of this entry; past that, go
    on: entries are checked by content, so an unlocked build only costs time."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                logger.warning("nanokv CPU kernels: %s still held after %d s; building anyway", f.name,
                               BUILD_TIMEOUT_S)
                return
            time.sleep(0.1)


_private: Path | None = None


def _private_folder(error: OSError) -> Path:
    """This process's own kernel folder (a temporary one, removed at exit), for a cache
    root that cannot be written to; said once."""
    global _private
    if _private is None:
        _private = Path(tempfile.mkdtemp(prefix="nanokv-kernels-"))
        atexit.register(shutil.rmtree, _private, ignore_errors=True)
        logger.warning("nanokv CPU kernels: cannot write to the cache %s (%s); building into %s, removed at exit"
                       " (NANOKV_CACHE_DIR sets a writable cache)", cache_dir(), error, _private)
    return _private
