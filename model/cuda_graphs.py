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
from typing import TypeVar

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
# Up to this many inputs a batch is padded row by row: for so few, the fixed cost of the few
# whole-array steps is the larger (docs/benchmarks.md).
ROW_BY_ROW = 8

IntGrid = npt.NDArray[np.int64]
# A pass's inputs in one buffer: on the host (numpy) or on the GPU (torch).
Flat = TypeVar("Flat", IntGrid, Tensor)
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
    return inputs_in(padded_inputs(ids, prompt_lengths, shape, pad_id), shape)


def padded_inputs(
    ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    shape: tuple[int, int],
    pad_id: int,
) -> IntGrid:
    """`padded_batch`'s arrays laid out in one flat buffer (`inputs_in`)."""
    flat = np.empty(input_values(shape), dtype=np.int64)
    write_padded(ids, prompt_lengths, pad_id, *inputs_in(flat, shape))
    return flat


def input_values(shape: tuple[int, int]) -> int:
    """How many values a pass's inputs hold, laid out one after another (`inputs_in`)."""
    rows, width = shape
    return 2 * rows * width + rows


def inputs_in(flat: Flat, shape: tuple[int, int]) -> tuple[Flat, Flat, Flat]:
    """The ids, the mask and the prompt lengths of a `shape` batch as views of one flat
    buffer, so that a graph's inputs cross to the GPU in a single copy."""
    rows, width = shape
    cells = rows * width
    grid = flat[:cells].reshape(rows, width)
    mask = flat[cells : 2 * cells].reshape(rows, width)
    return grid, mask, flat[2 * cells : 2 * cells + rows]


def write_padded(
    ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    pad_id: int,
    grid: IntGrid,
    mask: IntGrid,
    prompts: IntGrid,
) -> None:
    """`padded_batch` into arrays that exist (whatever they held before)."""
    count = len(ids)
    grid.fill(pad_id)
    mask.fill(0)
    if count <= ROW_BY_ROW:
        for row, sequence in enumerate(ids):
            grid[row, : len(sequence)] = sequence
            mask[row, : len(sequence)] = 1
    else:
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=count)
        real = np.arange(grid.shape[1]) < lengths[:, None]
        # Row-major boolean indexing: the batch's ids, in order, land in their rows' first cells.
        grid[:count][real] = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())
        )
        mask[:count][real] = 1
    mask[count:, 0] = 1
    prompts.fill(0)
    prompts[:count] = prompt_lengths


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


# Pinned buffers per graph: the batch worker writes one batch's inputs while the pass before
# still runs, whose copy may not have left its buffer yet.
SLOTS = 2


@dataclass(frozen=True)
class _Staged:
    """Pinned host memory laid out as a graph's inputs (`inputs_in`), and its three arrays."""

    host: Tensor
    arrays: tuple[IntGrid, IntGrid, IntGrid]


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: Tensor  # on the GPU, flat: ids, mask and prompt lengths, read by the replay
    vectors: Tensor
    # Views made once (a slice per pass would be one more torch call): the first n rows of
    # `vectors`, by n; and the inputs' pinned buffers, by slot.
    rows: tuple[Tensor, ...]
    staged: tuple[_Staged, ...]


def wait_for(event: torch.cuda.Event) -> None:
    """Until the event has happened (at once if it never was recorded). Asks first:
    `query` keeps the GIL, `synchronize` lets go of it, and getting it back can wait for as
    long as the thread that took it meanwhile keeps it."""
    if not event.query():  # type: ignore[no-untyped-call]
        event.synchronize()


class GraphedForward:
    """The pooled forward pass as captured CUDA graphs, one per bucket. Call from the one
    thread that runs the model, in inference mode, on the stream current when it was made
    (the default one): the events that say a pass's copies are done are recorded there."""

    def __init__(self, forward: PooledForward, device: torch.device, max_width: int) -> None:
        self.forward = forward
        self.device = device
        self.max_width = max_width
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # One stream for every warm-up: the allocator keeps freed memory per stream, so a new
        # stream per capture would keep a cache of its own each.
        self._side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # The stream passes run on, looked up once (a lookup per pass costs like a copy).
        self._stream = torch.cuda.current_stream(device)
        # Slots are taken in turn, whatever the graph. Recorded behind each slot's last pass
        # (its vectors' copy): once it has happened, so has every earlier pass's copy from a
        # buffer of that slot. One event per slot, recorded again each time: creating and
        # freeing one per pass each let go of the GIL.
        self._passed = [torch.cuda.Event() for _ in range(SLOTS)]  # type: ignore[no-untyped-call]
        self._turn = 0

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        return bucket(batch, width, self.max_width)

    def capture_all(self) -> int:
        """Capture every bucket now (largest first, so that the pool is sized once) rather than
        on a request's time; returns how many there are."""
        for shape in all_buckets(self.max_width):
            self._graph(shape)
        return len(self._graphs)

    def launch(
        self,
        ids: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        shape: tuple[int, int],
        pad_id: int,
    ) -> tuple[Tensor, torch.cuda.Event]:
        """Queue a batch's pass, padded to the bucket `shape`, and the copy of its vectors
        into pinned CPU memory behind it; return before the GPU has run either. The vectors
        are there once the event has happened (`wait_for`). The pass after next records the
        same event again (after waiting for it): a wait begun after that ends later, never
        sooner."""
        graph = self._graph(shape)
        slot = self._turn
        self._turn = (slot + 1) % SLOTS
        arrived = self._passed[slot]
        wait_for(arrived)  # the slot's last pass: answered already, as a rule
        staged = graph.staged[slot]
        write_padded(ids, prompt_lengths, pad_id, *staged.arrays)
        # From pinned memory, queued on the stream: a copy from pageable memory would wait
        # for the GPU to finish the pass before it (the host thread blocked all the while).
        graph.inputs.copy_(staged.host, non_blocking=True)
        graph.graph.replay()
        # The graph's own output is overwritten by the next replay: copied before it.
        vectors = graph.rows[len(ids)].to("cpu", non_blocking=True)
        arrived.record(self._stream)
        return vectors, arrived

    def _graph(self, shape: tuple[int, int]) -> _Graph:
        if shape in self._graphs:
            return self._graphs[shape]
        inputs = torch.from_numpy(padded_inputs([], [], shape, pad_id=0)).to(self.device)
        ids, mask, prompts = inputs_in(inputs, shape)
        self._side.wait_stream(self._stream)
        with torch.cuda.stream(self._side):
            for _ in range(WARM_UP_RUNS):
                self.forward(ids, mask, prompts)
        self._stream.wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                vectors = self.forward(ids, mask, prompts)
        except RuntimeError as exc:
            raise RuntimeError(
                f"capturing the CUDA graph of a {shape[0]} x {shape[1]} batch failed ({exc}); "
                "start with --no-cuda-graphs (EMBED_CUDA_GRAPHS=false) to run eagerly"
            ) from exc
        staged = []
        for _ in range(SLOTS):
            host = torch.empty_like(inputs, device="cpu").pin_memory()
            staged.append(_Staged(host, inputs_in(host.numpy(), shape)))
        rows = tuple(vectors[:count] for count in range(shape[0] + 1))
        self._graphs[shape] = _Graph(graph, inputs, vectors, rows, tuple(staged))
        return self._graphs[shape]
