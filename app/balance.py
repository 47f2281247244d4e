"""Evening out keep-alive connections over the front ends (the split placement).

The kernel places each new connection on a worker by a hash of its addresses, and the
connection then stays there: with a few long-lived clients, one worker can hold them all
while another idles, and the server then runs at the speed of one. Each worker publishes how
many connections it holds, in memory the supervisor shares with all of them, several times a
second; a worker holding more than its share asks that many clients to reconnect, with
`Connection: close` on their next response, and the kernel places the new connections anew.
Idle connections cost nothing and are left alone.
"""

from __future__ import annotations

import ctypes
import math

# One slot per worker: the connections it holds.
Counts = ctypes.Array[ctypes.c_int]


class ConnectionBalance:
    """One worker's view: its slot in the shared counts, and the connections it should shed."""

    def __init__(self, counts: Counts, index: int) -> None:
        self.counts = counts
        self.index = index
        self._to_close = 0

    def publish(self, held: int) -> None:
        """Record the connections this worker holds, and how many are over its share."""
        self.counts[self.index] = held
        share = math.ceil(sum(self.counts) / len(self.counts))
        self._to_close = max(0, held - share)

    def should_close(self) -> bool:
        """Whether the response being sent should close its connection."""
        if self._to_close <= 0:
            return False
        self._to_close -= 1
        return True
