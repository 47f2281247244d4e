"""What each engine publishes for the front ends: its backlog, in a small shared file mapped
into every process (no message per request, no lock).

One row of float64 per engine: tokens queued and running, seconds per token. The engine
writes its row after every change to its queue; front ends read every row to admit work (the
fast 429) and to send it to the engine that will finish it first. A torn read of a row that
is being written costs one admission decision a few tokens off.
"""

from __future__ import annotations

import mmap
from pathlib import Path

FIELDS = 2  # backlog tokens, seconds per token


class EngineBoard:
    def __init__(self, path: Path, engines: int) -> None:
        size = engines * FIELDS * 8
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), size)
        # The float64 cells as Python floats: a front end reads the board twice a request,
        # and numpy's indexing of one scalar costs more than the read.
        self._cells = memoryview(self._map).cast("d")
        self._engines = engines

    @classmethod
    def create(cls, path: Path, engines: int) -> EngineBoard:
        """A zeroed board, made by the supervisor."""
        with path.open("wb") as file:
            file.truncate(engines * FIELDS * 8)
        return cls(path, engines)

    def __len__(self) -> int:
        return self._engines

    def publish(self, engine: int, backlog: int, seconds_per_token: float) -> None:
        at = engine * FIELDS
        self._cells[at] = backlog
        self._cells[at + 1] = seconds_per_token

    def backlog(self, engine: int) -> tuple[int, float]:
        """Tokens queued and running, and the recent seconds per token."""
        at = engine * FIELDS
        return int(self._cells[at]), self._cells[at + 1]

    def seconds_ahead(self, engine: int) -> float:
        at = engine * FIELDS
        seconds: float = self._cells[at] * self._cells[at + 1]
        return seconds
