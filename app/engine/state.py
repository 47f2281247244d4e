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

import numpy as np

FIELDS = 2  # backlog tokens, seconds per token


class EngineBoard:
    def __init__(self, path: Path, engines: int) -> None:
        size = engines * FIELDS * 8
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), size)
        self.rows = np.ndarray((engines, FIELDS), dtype=np.float64, buffer=self._map)

    @classmethod
    def create(cls, path: Path, engines: int) -> EngineBoard:
        """A zeroed board, made by the supervisor."""
        with path.open("wb") as file:
            file.truncate(engines * FIELDS * 8)
        return cls(path, engines)

    def __len__(self) -> int:
        return len(self.rows)

    def publish(self, engine: int, backlog: int, seconds_per_token: float) -> None:
        row = self.rows[engine]
        row[0] = backlog
        row[1] = seconds_per_token

    def backlog(self, engine: int) -> tuple[int, float]:
        """Tokens queued and running, and the recent seconds per token."""
        row = self.rows[engine]
        return int(row[0]), float(row[1])

    def seconds_ahead(self, engine: int) -> float:
        tokens, pace = self.backlog(engine)
        return tokens * pace
