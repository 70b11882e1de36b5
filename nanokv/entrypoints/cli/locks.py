"""One run at a time on an output: an flock'ed `<output>.lock` naming its holder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time

from nanokv.entrypoints.cli.common import InputError
from nanokv.entrypoints.cli.records import lock_guards


class FileLock:
    """An exclusive flock(2) on `<target>.lock`, a file naming its holder. The kernel drops
    the lock when the holder dies, so a killed run never blocks its resume; a lock file
    left behind is the trace of a run that did not finish (`stale`), which is what lets a
    file holding only a torn line be cut. Removed on release while still locked (whoever
    opened the old file before then finds it unlinked after its flock and retries), except
    when it must stay as that trace: the run was killed before it checked the files, or
    one of the files it guards (`guards`, checked to be nanokv's since) ends in a torn line,
    as a failed write (disk full, quota, file size limit) leaves one."""

    def __init__(self, target: str, holder: str, guards: tuple[str, ...] = ()):
        self.target, self.path = target, target + ".lock"
        self.guards = guards  # the files this lock guards: what a torn line is looked for in
        self.stale = False  # it named a holder when taken: a run on these files was killed
        self.settled = False  # the files it guards were checked (and repaired) since: nanokv's
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
        if previous and not previous.startswith(_HOLDER) and not _HOLDER.startswith(previous):
            os.close(fd)
            raise InputError(f"{self.path} exists and nanokv did not write it; move it away")
        # a whole holder line: a run that took the lock was killed; a line cut inside "nanokv "
        # (a run that could not write it, then stopped) is no evidence of any other file
        self.stale = previous.startswith(_HOLDER)
        line = f"{_HOLDER.decode()}{holder} pid {os.getpid()} on {socket.gethostname()} since " \
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        try:  # written before the old line is cut: on a full disk the trace stays
            _pwrite_all(fd, line.encode())
            os.ftruncate(fd, len(line.encode()))
            os.fsync(fd)  # the trace must outlive a machine crash too
        except OSError as e:
            if not previous:  # ours, new, and maybe holding a few bytes that do not say nanokv: gone
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            os.close(fd)
            raise InputError(f"cannot write the lock file {self.path}: {e.strerror}; make room (disk space, "
                             "quota, file size limit) and rerun the same command") from None
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        trace = (self.stale and not self.settled) or (self.settled and any(map(_ends_torn, self.guards)))
        if not trace:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


_HOLDER = b"nanokv "  # how a lock file's holder line begins (a file cut inside it is still ours)


def _pwrite_all(fd: int, data: bytes) -> None:
    """All of data at offset 0: a short write (a file size limit, a nearly full disk) goes
    on until the rest is written or the write raises (EFBIG, ENOSPC)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)


def _ends_torn(path: str) -> bool:
    """Whether `path` ends in a line without a newline (a write cut short); True when it
    cannot be read, as keeping the trace is the safe side."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


class Locks:
    """The locks this process holds on `output`'s files, by the path each guards (the
    output or an output part)."""

    def __init__(self, holder: str, output: str):
        self.holder, self.output = holder, output
        self._held: dict[str, FileLock] = {}

    def take(self, target: str) -> FileLock:
        if target not in self._held:
            self._held[target] = FileLock(target, self.holder, lock_guards(self.output, target))
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
