"""Python's cyclic collector in a serving process, set once start-up is done.

- What start-up made (modules, the model, the app) lives as long as the process: frozen out
  of the collector's sight, a full collection takes milliseconds instead of the hundreds
  during which the event loop would answer nothing (bench/soak.py).
- A young collection runs whenever tracked objects made exceed those freed by CPython's
  default of 700. The requests in flight hold about that many between them, so under load the
  default ran a young collection every few dozen requests, each going through every in-flight
  request's objects, which are alive and not garbage. At 10,000 it is crossed by what outlives
  its request, or by many times more requests in flight: at 256, 3 or 4 times in 6 s
  (docs/benchmarks.md). The older generations keep their defaults.
"""

from __future__ import annotations

import gc

# Tracked objects made beyond those freed before a young collection runs (CPython's default
# is 700).
YOUNG_THRESHOLD = 10_000


def settle_collector() -> None:
    """Collect once, freeze what survives, and make young collections rarer."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
