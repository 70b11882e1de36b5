"""Client connections: a request must arrive whole within a time, and connections never
use up the process's file descriptors.

uvicorn times out only idle keep-alive connections, after a response; a connection that
opens and sends nothing, or half its headers, or half its body, stays open for good. A
few thousand of them used up the descriptors (`ulimit -n` 1024), the accept loop then
failed, and every client, /health included, was locked out. So:

- At start the soft RLIMIT_NOFILE is raised to the hard limit (as vLLM does), and the
  connections are capped below it: the limit less the descriptors already open, less
  FD_RESERVE for what the engine and the logs open (checked before the model loads, so
  that a limit too low fails at once).
- At the cap, a new connection closes the oldest one that is not being served: first
  those with no request under way (nothing sent yet, half the headers, or idle between
  requests), then those whose body is still arriving (the app waits on the client, so a
  client that sends headers and a trickle of body cannot hold the slots); when every
  connection is being served, the new one gets 503 and is closed.
- From its first byte (or from the connection's opening) a request has
  `timeout_request_read` seconds to arrive whole, headers and body; then the connection
  is closed (408 when its headers never completed).
- A response whose client stops reading it fills the socket's buffers, and the transport
  pauses the writes (flow control): the app waits on the client, the request holds its
  engine work and KV blocks, and the connection its slot, for good. A connection whose
  writes stay paused for `timeout_response_write` seconds is dropped (its unsent bytes
  discarded): the app sees a disconnect and aborts the request. At the cap such stalled
  connections are closed last, after those with no request under way and those whose
  body is still arriving.

The protocol is uvicorn's own (h11, or httptools when installed) with these hooks on top.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket

from nanokv.entrypoints.openai.protocol import error_body
from nanokv.entrypoints.openai.serving import dumps

logger = logging.getLogger("nanokv")

FD_RESERVE = 128  # descriptors kept from connections: the model's files, the engine's pipes and workers, logs
MIN_CONNECTIONS = 16  # a cap below this means the descriptor limit is too low to serve
BACKLOG = 2048  # the listen backlog (uvicorn's default) where descriptors are plenty


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit in effect after."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 1 << 16
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # a hard limit above what the kernel allows (nr_open)
        pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _open_descriptors() -> int:
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path))
        except OSError:
            continue
    return 0


def connection_limits(requested: int | None, fd_limit: int) -> tuple[int, int]:
    """(the most client connections, the backlog asyncio accepts at a time) under `fd_limit` descriptors:
    `requested` (--max-connections) or all the descriptors left; ValueError when too few.

    asyncio accepts up to a backlog of connections each time the listening socket wakes it,
    and a few wake-ups can pass before their connection_made counts them (and closes the
    oldest idle ones); at EMFILE it logs a traceback per failed accept. So 4 backlogs of
    descriptors stay free beyond the cap, and the backlog shrinks with the limit."""
    room = fd_limit - _open_descriptors() - FD_RESERVE
    backlog = max(16, min(BACKLOG, room // 16))
    most = room - 4 * backlog
    if requested is not None and requested > most:
        raise ValueError(f"--max-connections {requested} needs more file descriptors than the limit of {fd_limit} "
                         f"leaves ({most} connections; ulimit -n); lower it or raise the hard limit (ulimit -Hn)")
    cap = most if requested is None else requested
    if cap < MIN_CONNECTIONS:
        raise ValueError(f"the file descriptor limit of {fd_limit} (ulimit -n) leaves room for {max(cap, 0)} "
                         f"connections, fewer than {MIN_CONNECTIONS}; raise it")
    return cap, backlog


def listen_queue(fileno: int) -> None:
    """Let the kernel queue BACKLOG connections on a listening socket: asyncio gives
    listen() the backlog it also accepts at a time, which connection_limits may have
    lowered, and a short queue makes a burst of clients wait a second for SYN retries."""
    sock = socket.socket(fileno=fileno)
    try:
        sock.listen(BACKLOG)
    finally:
        sock.detach()


def _raw_response(status: int, reason: str, message: str, headers: str = "") -> bytes:
    body = dumps(error_body(status, message))
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n{headers}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def guarded_protocol(base: type[asyncio.Protocol], max_connections: int, read_timeout: float,
                     write_timeout: float) -> type:
    """`base` (a uvicorn HTTP protocol class) with the read and write deadlines and the
    connection cap."""
    # connections not being served, oldest first: the ones a new connection may close at
    # the cap. idle: no request under way (none yet, its headers still arriving, or idle
    # after a response); arriving: the headers came, the body is still coming; stalled:
    # the client does not read what is sent to it (writes paused)
    idle: collections.OrderedDict = collections.OrderedDict()
    arriving: collections.OrderedDict = collections.OrderedDict()
    stalled: collections.OrderedDict = collections.OrderedDict()
    timed_out = _raw_response(408, "Request Timeout", f"the request did not arrive whole within {read_timeout:g} s "
                              "(--timeout-request-read); send it again")
    full = _raw_response(503, "Service Unavailable", f"the server is at its {max_connections} connections "
                         "(--max-connections); retry later", "retry-after: 1\r\n")

    class Guarded(base):
        def connection_made(self, transport) -> None:
            self._deadline: asyncio.TimerHandle | None = None
            self._write_deadline: asyncio.TimerHandle | None = None
            self._whole = None  # the last request cycle that arrived whole
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._make_room():
                self.connections.discard(self)
                transport.write(full)
                transport.close()
                return
            idle[self] = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if cycle is None or (cycle is self._whole and cycle.response_complete):
                self._arm()  # the first bytes of a request
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request
            self._track()

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            arriving.pop(self, None)
            stalled.pop(self, None)
            self._disarm()
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:  # the transport's buffer is past its high-water mark
            super().pause_writing()
            if self._write_deadline is None:
                self._write_deadline = self.loop.call_later(write_timeout, self._write_timed_out)
            stalled[self] = None

        def resume_writing(self) -> None:  # the client read enough of it
            super().resume_writing()
            stalled.pop(self, None)
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _write_timed_out(self) -> None:
            self._write_deadline = None
            for waiting in (idle, arriving, stalled):
                waiting.pop(self, None)
            logger.info("closing a connection whose client read none of its response for %g s "
                        "(--timeout-response-write)", write_timeout)
            # close() would wait to send the buffered bytes to a client that does not read
            # them (also once closing: a keep-alive timeout or a `connection: close` response)
            self.transport.abort()

        def _track(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle is not self._whole:
                if cycle.more_body:
                    self._arm()
                else:  # all of it arrived: what remains is the app's (and keep-alive's) time
                    self._whole = cycle
                    self._disarm()
            if cycle is not None and not cycle.response_complete:
                idle.pop(self, None)
                if cycle is self._whole:
                    arriving.pop(self, None)
                elif self not in arriving and not self.transport.is_closing():
                    arriving[self] = None
            elif not self.transport.is_closing():
                arriving.pop(self, None)
                idle[self] = None
                idle.move_to_end(self)

        def _make_room(self) -> bool:
            for waiting in (idle, arriving, stalled):
                while waiting:
                    oldest, _ = waiting.popitem(last=False)
                    if oldest.flow.write_paused:  # close() would wait on a client that does not read
                        logger.debug("at %d connections: dropping the oldest one not reading its response",
                                     max_connections)
                        oldest.transport.abort()
                        return True
                    if not oldest.transport.is_closing():
                        logger.debug("at %d connections: closing the oldest one not being served", max_connections)
                        oldest.transport.close()
                        return True
            return False

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _read_timed_out(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle is self._whole:  # its headers never arrived: nothing runs, answer 408
                self.transport.write(timed_out)
            # else the app waits for the body: closing the connection ends its read as a disconnect
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
