"""Prometheus metrics, prefix `embed_`, explicit buckets, one registry per app.

Under the split placement, prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR,
set by app/supervisor.py) keeps each process's values in files, engines' and front ends'
alike, and a scrape reports them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from app.tally import Tally

MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Where an engine writes its queue gauges to the shared metrics files, arrivals write them at
# most this often: a write per request cost the engine more than admitting the request.
GAUGE_INTERVAL = 0.05


class Metrics:
    """All of the service's metrics; a fresh registry keeps test apps apart."""

    def __init__(self) -> None:
        # prometheus_client keeps values in files exactly when this variable is set.
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_VARIABLE)
        self.registry = CollectorRegistry()
        # The per-request figures of the HTTP and gRPC paths, written in bulk (app/tally.py).
        self.tally = Tally()
        r = self.registry
        self.requests = Counter(
            "embed_requests",
            "HTTP requests and gRPC calls by route (or method) and status.",
            ["route", "status"],
            registry=r,
        )
        self.failures = Counter(
            "embed_failures", "Failed requests by reason (error type).", ["reason"], registry=r
        )
        self.connections_rebalanced = Counter(
            "embed_connections_rebalanced",
            "Connections closed after a response to even them out over the front ends.",
            registry=r,
        )
        # The model's own work, labelled by the served model's name (several models, one
        # server): each has its own queue, batches and forward passes.
        per_model = ["model"]
        self.forward_passes = Counter(
            "embed_forward_passes",
            "Forward passes by the torch threads they ran on (several CPU engines, app/cores.py).",
            ["model", "threads"],
            registry=r,
        )
        self.forward_cpu_seconds = Counter(
            "embed_forward_cpu_seconds",
            "CPU time of the thread that ran the forward passes, during them (its OpenMP "
            "workers' not counted): below embed_inference_duration_seconds' sum by the time "
            "passes waited, for a core or a GPU.",
            per_model,
            registry=r,
        )
        self.inputs = Counter("embed_inputs", "Inputs embedded.", per_model, registry=r)
        self.tokens = Counter(
            "embed_tokens", "Tokens embedded (padding excluded).", per_model, registry=r
        )
        self.queue_depth = Gauge(
            "embed_queue_depth",
            "Inputs waiting for the model.",
            per_model,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_tokens = Gauge(
            "embed_queue_tokens",
            "Tokens of the inputs waiting for the model.",
            per_model,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_size = Histogram(
            "embed_batch_size",
            "Inputs per forward pass.",
            per_model,
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "embed_batch_tokens",
            "Padded tokens (longest x count) per forward pass.",
            per_model,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.padding_ratio = Histogram(
            "embed_padding_ratio",
            "Share of a batch's padded tokens that are padding.",
            per_model,
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.tokenization_seconds = self._duration(
            "tokenization", "Tokenizing one request.", per_model
        )
        self.queue_seconds = self._duration(
            "queue",
            "An answered request's wait in the model's queue (its longest-waiting input's); "
            'one that ran out of time counts in embed_failures_total{reason="Timeout"}.',
            per_model,
        )
        self.inference_seconds = self._duration(
            "inference",
            "One forward pass, until its output is back, from its launch or, where it was "
            "queued on a GPU behind the pass before it, that pass's end.",
            per_model,
        )
        self.request_seconds = self._duration(
            "request", "One HTTP request or gRPC call, end to end."
        )
        self.input_tokens = Histogram(
            "embed_input_tokens", "Tokens per input.", per_model, buckets=TOKEN_BUCKETS, registry=r
        )
        self.model_info = Gauge(
            "embed_model_info",
            "The served model (value 1).",
            ["model", "dtype", "device"],
            registry=r,
            multiprocess_mode="max",
        )

    def of(self, model: str) -> ModelMetrics:
        """The metrics of one served model's work."""
        return ModelMetrics(self, model)

    def render(self) -> bytes:
        """The exposition text: this process's values, or every worker's summed."""
        self.tally.flush()
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        workers = CollectorRegistry()
        MultiProcessCollector(workers, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(workers)

    def _duration(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Histogram:
        return Histogram(
            f"embed_{name}_duration_seconds",
            documentation,
            labels,
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )


class ModelMetrics:
    """One served model's children of the labelled metrics, named as the families are."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.model = model
        self.tally = metrics.tally
        self.multiprocess_dir = metrics.multiprocess_dir
        self.model_info = metrics.model_info
        self._forward_passes = metrics.forward_passes
        self.inputs = metrics.inputs.labels(model)
        self.tokens = metrics.tokens.labels(model)
        self.queue_depth = metrics.queue_depth.labels(model)
        self.queue_tokens = metrics.queue_tokens.labels(model)
        self.batch_size = metrics.batch_size.labels(model)
        self.batch_tokens = metrics.batch_tokens.labels(model)
        self.padding_ratio = metrics.padding_ratio.labels(model)
        self.tokenization_seconds = metrics.tokenization_seconds.labels(model)
        self.queue_seconds = metrics.queue_seconds.labels(model)
        self.inference_seconds = metrics.inference_seconds.labels(model)
        self.forward_cpu_seconds = metrics.forward_cpu_seconds.labels(model)
        self.input_tokens = metrics.input_tokens.labels(model)

    def forward_passes_on(self, threads: int) -> Counter:
        """The forward passes' counter of passes on `threads` threads."""
        counter: Counter = self._forward_passes.labels(self.model, str(threads))
        return counter

    def watch_queue(
        self, depth: Callable[[], int], tokens: Callable[[], int]
    ) -> Callable[[bool], None]:
        """Wire the queue gauges to the batcher's queue; it calls the function returned after
        each change to it, saying whether inputs arrived. One process reads the queue when
        /metrics is scraped instead, and the function does nothing (it would run twice per
        request). Engines must write the gauges, since a scrape may reach another worker:
        after arrivals at most every GAUGE_INTERVAL, after any other change (a batch taken,
        inputs dropped) at once, so that a queue left empty reads empty."""
        if self.multiprocess_dir is None:
            self.queue_depth.set_function(depth)
            self.queue_tokens.set_function(tokens)
            return _nothing
        due = 0.0  # time.monotonic() from which arrivals write the gauges again

        def publish(arrival: bool) -> None:
            nonlocal due
            now = time.monotonic()
            if arrival and now < due:
                return
            due = now + GAUGE_INTERVAL
            self.queue_depth.set(depth())
            self.queue_tokens.set(tokens())

        return publish


def _nothing(arrival: bool) -> None:
    pass
