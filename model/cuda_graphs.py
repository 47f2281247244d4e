"""CUDA graphs for the embedding forward pass: one replay instead of a hundred kernel launches.

On a GPU a small batch's forward pass is bound by the CPU: Python launches each of its kernels
one by one, holding the GIL the server's event loop also needs. A graph captured once per
batch shape replays all of them in one call. Batches are padded up to the nearest captured
shape (a bucket): an extra row holds one pad token (a row with no token at all would give
attention nothing to attend to), extra columns are masked out, and only the real rows are
read back. Graphs are used where launching dominates, up to GRAPH_MAX_TOKENS padded tokens;
larger batches, and those that want per-token vectors or attention maps, run eagerly.

Every graph shares one memory pool: they run one at a time, on one stream, and each one's
output is copied off the GPU (the copy queued on that stream) before the next replay.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WIDTH_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Past this many padded tokens the GPU's own work outweighs launching it.
GRAPH_MAX_TOKENS = 4096
# Eager runs before a capture: the first ones choose kernels and allocate workspaces.
WARM_UP_RUNS = 2

IntGrid = npt.NDArray[np.int64]
# (B, T) ids, (B, T) 1/0 mask, (B,) prompt lengths -> (B, dimensions) float32 vectors.
PooledForward = Callable[[Tensor, Tensor, Tensor], Tensor]


def padded_batch(
    ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    shape: tuple[int, int],
    pad_id: int,
) -> tuple[IntGrid, IntGrid, IntGrid]:
    """Right-padded (rows, width) ids and 1/0 mask, and (rows,) prompt lengths, for a batch of
    at most `rows` inputs of at most `width` tokens. Rows past the batch's hold one pad token."""
    rows, width = shape
    grid = np.full((rows, width), pad_id, dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    if rows > len(ids):
        mask[len(ids) :, 0] = 1
    for row, sequence in enumerate(ids):
        grid[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    prompts = np.zeros(rows, dtype=np.int64)
    prompts[: len(prompt_lengths)] = prompt_lengths
    return grid, mask, prompts


def bucket(batch: int, width: int, max_width: int) -> tuple[int, int] | None:
    """The captured shape a batch of `batch` inputs of `width` tokens pads to; None when it
    runs eagerly. Widths stop at the model's `max_width`, which is a bucket of its own."""
    rows = next((size for size in BATCH_BUCKETS if size >= batch), None)
    widths = [w for w in WIDTH_BUCKETS if w < max_width] + [max_width]
    columns = next((w for w in widths if w >= width), None)
    if rows is None or columns is None or rows * columns > GRAPH_MAX_TOKENS:
        return None
    return rows, columns


def all_buckets(max_width: int) -> list[tuple[int, int]]:
    """Every shape `bucket` can choose, the most padded tokens first."""
    shapes = itertools.product(BATCH_BUCKETS, [*WIDTH_BUCKETS, max_width])
    kept = {s for s in shapes if bucket(*s, max_width) == s}
    return sorted(kept, key=lambda shape: shape[0] * shape[1], reverse=True)


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: Tensor
    mask: Tensor
    prompts: Tensor
    vectors: Tensor


class GraphedForward:
    """The pooled forward pass as captured CUDA graphs, one per bucket. Call from the one
    thread that runs the model, in inference mode."""

    def __init__(self, forward: PooledForward, device: torch.device, max_width: int) -> None:
        self.forward = forward
        self.device = device
        self.max_width = max_width
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # One stream for every warm-up: the allocator keeps freed memory per stream, so a new
        # stream per capture would keep a cache of its own each.
        self._side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        return bucket(batch, width, self.max_width)

    def capture_all(self) -> int:
        """Capture every bucket now (largest first, so that the pool is sized once) rather than
        on a request's time; returns how many there are."""
        for shape in all_buckets(self.max_width):
            self._graph(shape)
        return len(self._graphs)

    def __call__(self, ids: IntGrid, mask: IntGrid, prompts: IntGrid) -> Tensor:
        """Vectors for inputs padded to a bucket's shape (`padded_batch`), on the GPU: the
        graph's own output, overwritten by the next call's replay (queued on the current
        stream: the call returns before the GPU has run it)."""
        graph = self._graph((ids.shape[0], ids.shape[1]))
        # From pinned memory, queued on the stream: a copy from pageable memory would wait
        # for the GPU to finish the pass before it (the host thread blocked all the while).
        for source, target in ((ids, graph.ids), (mask, graph.mask), (prompts, graph.prompts)):
            target.copy_(torch.from_numpy(source).pin_memory(), non_blocking=True)
        graph.graph.replay()
        return graph.vectors

    def _graph(self, shape: tuple[int, int]) -> _Graph:
        if shape in self._graphs:
            return self._graphs[shape]
        ids, mask, prompts = (
            torch.from_numpy(array).to(self.device)
            for array in padded_batch([], [], shape, pad_id=0)
        )
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            for _ in range(WARM_UP_RUNS):
                self.forward(ids, mask, prompts)
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                vectors = self.forward(ids, mask, prompts)
        except RuntimeError as exc:
            raise RuntimeError(
                f"capturing the CUDA graph of a {shape[0]} x {shape[1]} batch failed ({exc}); "
                "start with --no-cuda-graphs (EMBED_CUDA_GRAPHS=false) to run eagerly"
            ) from exc
        self._graphs[shape] = _Graph(graph, ids, mask, prompts, vectors)
        return self._graphs[shape]
