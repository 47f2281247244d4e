"""Per-request and per-pass figures, counted in plain Python and written to the metrics in
bulk: one write per series when flushed, instead of one per figure.

prometheus_client writes every `inc` and `observe` under a lock and, under the split
placement, into a shared file: eleven writes for a one-input request, about a tenth of the
split server's CPU per request (`python -m bench.serving_cost`; docs/benchmarks.md). What is held is
written when its owner goes quiet (the event loop with no HTTP request or gRPC call left in
progress, a batch worker about to wait for work, and before it answers a batch that left it
idle, nothing queued or running: a quiet server's metrics are exact), the event loop's when
its process renders the metrics, and otherwise `interval` seconds after the first figure
held (by a timer on the event loop, or by the first figure after that on a thread without
one): under load a scrape shows a process's figures as they were about that long ago.

A tally belongs to one thread: the event loop's (the HTTP and gRPC paths) or a batch
worker's (its passes).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left

from prometheus_client import Counter, Histogram

# The longest a figure waits in a busy process before it is written.
FLUSH_SECONDS = 1.0


class _Observations:
    """Observations of one histogram series, per bucket, as prometheus_client keeps them."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, histogram: Histogram) -> None:
        self.bounds = histogram._upper_bounds  # ends with +Inf: every value has a bucket
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def add(self, value: float) -> None:
        # The first bound >= value, as `Histogram.observe` picks its bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def write(self, histogram: Histogram) -> None:
        # `observe` takes one value; its bucket values are per bucket (made cumulative when
        # collected), so counts are added to them as they are.
        histogram._sum.inc(self.total)
        for bucket, count in zip(histogram._buckets, self.counts, strict=True):
            if count:
                bucket.inc(count)


class Tally:
    def __init__(self, interval: float = FLUSH_SECONDS) -> None:
        self.interval = interval
        self._counts: dict[Counter, float] = {}
        self._observed: dict[Histogram, _Observations] = {}
        self._due: float | None = None  # time.monotonic() by which what is held is written
        self._timer: asyncio.TimerHandle | None = None
        self._in_progress = 0  # requests begun and not yet ended (`begin`, `end`)

    def count(self, counter: Counter, amount: float = 1.0) -> None:
        """`counter.inc(amount)`, at the next flush; `counter` has its labels."""
        self._counts[counter] = self._counts.get(counter, 0.0) + amount
        self._held()

    def observe(self, histogram: Histogram, value: float) -> None:
        """`histogram.observe(value)`, at the next flush; `histogram` has its labels."""
        observations = self._observed.get(histogram)
        if observations is None:
            observations = self._observed[histogram] = _Observations(histogram)
        observations.add(value)
        self._held()

    def begin(self) -> None:
        """A request (HTTP or gRPC) is in progress."""
        self._in_progress += 1

    def end(self) -> None:
        """A request has ended; with none left in progress, what is held is written (a quiet
        server's metrics are exact)."""
        self._in_progress -= 1
        if self._in_progress == 0:
            self.flush()

    def flush(self) -> None:
        """Write every figure held."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due = None
        if not self._counts and not self._observed:
            return
        counts, self._counts = self._counts, {}
        observed, self._observed = self._observed, {}
        for counter, amount in counts.items():
            counter.inc(amount)
        for histogram, observations in observed.items():
            observations.write(histogram)

    def _held(self) -> None:
        if self._due is None:
            self._due = time.monotonic() + self.interval
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a worker thread: its next figure past the due time flushes
                return
            self._timer = loop.call_later(self.interval, self.flush)
        elif self._timer is None and time.monotonic() >= self._due:
            self.flush()
