"""What every part of the CLI shares: exit codes, the two error kinds, messages."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass


EXIT_OK = 0


EXIT_USAGE = 2  # bad flags, ids or paths, a model that does not load, a failed engine or rank


EXIT_FAILED_LINES = 3  # the job ran, but some lines are in the errors file


EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it)


logger = logging.getLogger("nanokv")


class InputError(ValueError):
    """The input as a whole is unusable (duplicate or missing ids), or a path is (a file
    nanokv did not write, the input named as output, a missing directory, a held lock)."""


class RunFailed(Exception):
    """The run cannot go on: the engine failed (a dead worker, a closed engine) or another
    torchrun rank did. What was flushed stays; rerunning the command resumes."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def say(*parts: str) -> None:
    print("".join(parts), file=sys.stderr, flush=True)


def valid_id(request_id) -> bool:
    return isinstance(request_id, str) or (isinstance(request_id, int) and not isinstance(request_id, bool))


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
