"""An engine's torch side: the model on its compute thread, warmed up, and its batch queue.

Both placements run this: in the front end's process (app/engine/local.py) or in a process
of its own (app/engine/process.py). Results leave through `deliver`, on the compute thread.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from app.cores import CoreLease
from app.engine.batcher import Batcher, Deliver
from app.engine.compute import ComputeThread
from app.metrics import ModelMetrics
from app.settings import ServedModel, Settings
from app.tasks import TASKS
from model import Embedder, Encoded
from model.codec import ModelCard
from model.prepacked import kernel_names
from model.quantization import builtin_calibration_texts, read_calibration_file
from model.shared_weights import WeightStore
from model.vectors import FloatArray

log = logging.getLogger(__name__)

# How long a thread may hold the GIL while another waits for it, on a GPU (Python's default
# is 5 ms). See `share_the_gil`.
GPU_SWITCH_INTERVAL = 0.0005


def share_the_gil(device: str) -> None:
    """On a GPU the compute thread seldom waits (the next pass is launched while the last one
    runs) and seldom lets go of the GIL for long; a thread waiting for the GIL (in process,
    the event loop) asks for it only after the switch interval. On a CPU every pass lets it
    go. (An engine of its own process has no such thread: its compute thread reads the front
    ends itself, app/engine/process.py.)"""
    if device.startswith("cuda"):
        sys.setswitchinterval(GPU_SWITCH_INTERVAL)


def warm_up_batch(embedder: Embedder) -> list[Encoded]:
    """A batch shaped like real traffic, so that its timing seeds the queue's estimate."""
    text = "a warm-up sentence of ordinary words and length " * 8
    return embedder.tokenize([text] * 16)


class ModelEngine:
    def __init__(
        self,
        settings: Settings,
        served: ServedModel,
        metrics: ModelMetrics,
        device: str,
        cores: CoreLease | None = None,
        weights: WeightStore | None = None,
    ) -> None:
        """`cores` and `weights`: this engine's share of the CPU's cores and the weights'
        shared memory, where several engines run on one CPU (app/cores.py,
        model/shared_weights.py)."""
        self.settings = settings
        self.served = served
        self.metrics = metrics
        self.device = device
        self.cores = cores
        self.weights = weights
        self.embedder: Embedder | None = None
        self.batcher: Batcher | None = None
        # Every torch call runs on this one thread (see app/engine/compute.py).
        self.compute: ComputeThread | None = None

    def load(self, deliver: Deliver) -> ModelCard:
        """Load the model, warm it up, embed the calibration texts (a task with codes), start
        the batch worker; blocks until done."""
        settings = self.settings
        threads = settings.engine_threads()
        log.info("%d torch threads", threads)
        # Loaded on the most threads a pass may take (all the engines' cores, for a lone
        # pass: app/cores.py), then run on its own: MKL lays a weight out for the threads
        # that pack it, and a single sentence packed on one thread ran on one thread's
        # speed on two (model/prepacked.py; docs/benchmarks.md).
        most = threads if self.cores is None else max(threads, self.cores.pool.size)
        self.compute = compute = ComputeThread(most)
        embedder = compute.submit(
            Embedder.load,
            self.served.model_id,
            task=settings.task,
            device=self.device,
            dtype=settings.dtype,
            allow_download=settings.allow_download,
            max_input_tokens=settings.max_input_tokens,
            cuda_graphs=settings.cuda_graphs,
            prepack=settings.prepack,
            compile=settings.compile,
        ).result()
        if most != threads:
            compute.submit(torch.set_num_threads, threads).result()
        if embedder.prepacked:
            kernels = kernel_names(embedder.network)
            log.info("%d linear layers prepacked (%s)", embedder.prepacked, kernels)
        if embedder.quantized:
            log.info("%d linear layers in int8", embedder.quantized)
        if self.weights is not None:  # before the warm-up, whose graphs keep the weights
            compute.submit(embedder.share_weights, self.weights).result()
        # A lone pass takes all the engines' cores, a pass beside others its own share.
        seconds_per_token = compute.submit(self._warm_up, embedder, {threads, most}).result()
        self.embedder = embedder
        info = embedder.info
        # Before the batch worker starts: from then on it holds the compute thread.
        calibration = None
        if TASKS[info.task].codes:
            calibration = compute.submit(self._calibrate, embedder).result()
        self.metrics.model_info.labels(self.served.name, info.dtype, info.device).set(1)
        share_the_gil(info.device)
        self.batcher = Batcher(
            embedder,
            self.metrics,
            deliver,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_inputs=settings.max_batch_inputs,
            max_attention_values=settings.max_attention_values,
            max_wait=settings.request_timeout,
            max_queue_wait=settings.max_queue_wait,
            batch_wait=settings.batch_wait(info.device),
            seconds_per_token=seconds_per_token,
            cores=self.cores if info.device == "cpu" else None,
        )
        self.batcher.start(compute)
        log.info(
            "ready: %s (%s, %s: %s)", info.model_id, info.device, info.dtype, info.dtype_reason
        )
        if info.device == "cpu" and (oversubscription := settings.cpu_oversubscription()):
            log.warning(oversubscription)
        # Requests and responses name the model as it is served.
        card = embedder.codec.card
        return replace(
            card, info=replace(card.info, model_id=self.served.name), calibration=calibration
        )

    def _calibrate(self, embedder: Embedder) -> FloatArray:
        """The model's vectors of the calibration texts, which set the int8 and uint8 ranges
        (model/quantization.py)."""
        path = self.settings.calibration_file
        texts = builtin_calibration_texts() if path is None else read_calibration_file(path)
        # Cut to the model's length, as requests are; the ranges are a set's minimum and
        # maximum, so the texts may run in any order: by length, in batches within the
        # batch limits.
        encoded = sorted(embedder.tokenize(texts), key=lambda item: len(item.ids))
        batches: list[list[Encoded]] = [[]]
        for item in encoded:
            batch = batches[-1]
            size = len(batch) + 1
            if batch and (
                size > self.settings.max_batch_inputs
                or size * len(item.ids) > self.settings.max_batch_tokens
            ):
                batches.append([])
            batches[-1].append(item)
        return np.concatenate([embedder.forward(batch).pooled.float().numpy() for batch in batches])

    @staticmethod
    def _warm_up(embedder: Embedder, thread_counts: set[int]) -> float:
        """Compile the passes for the thread counts a pass may run on (where asked for), run
        a batch (paying one-time costs), capture the CUDA graphs (on a GPU), then time the
        batch again; return its seconds per token."""
        started = time.perf_counter()
        if graphs := embedder.compile_passes(thread_counts):
            log.info("%d graphs compiled in %.1f s", graphs, time.perf_counter() - started)
        batch = warm_up_batch(embedder)
        embedder.forward(batch, token_embeddings=True)
        started = time.perf_counter()
        if graphs := embedder.capture_graphs():
            log.info("%d CUDA graphs captured in %.1f s", graphs, time.perf_counter() - started)
        started = time.perf_counter()
        embedder.forward(batch)
        return (time.perf_counter() - started) / sum(len(e.ids) for e in batch)

    @property
    def alive(self) -> bool:
        return self.batcher is not None and self.batcher.alive

    def stop(self) -> None:
        """The worker ends after its batch in progress, given up to `shutdown_grace`: the
        drain waits for requests, but a pass whose clients all left still runs, and a process
        that exits while torch's threads are inside a pass aborts (SIGABRT). Then the compute
        thread."""
        if self.batcher is not None:
            self.batcher.stop(self.settings.shutdown_grace)
        if self.compute is not None:
            self.compute.close()
