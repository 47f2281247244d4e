"""The CUDA-graph path's shapes and padding, on the CPU (the replay itself: test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model import Embedder
from model.cuda_graphs import (
    GRAPH_MAX_TOKENS,
    ROW_BY_ROW,
    all_buckets,
    bucket,
    input_values,
    inputs_in,
    padded_batch,
    write_padded,
)

TEXTS = ["hello", "a longer sentence of several words, and a comma", ""]


def test_a_batch_pads_up_to_the_nearest_bucket() -> None:
    assert bucket(1, 5, max_width=256) == (1, 32)
    assert bucket(3, 33, max_width=256) == (4, 64)
    assert bucket(17, 0, max_width=256) == (32, 32)
    assert bucket(2, 250, max_width=256) == (2, 256)
    assert bucket(1, 300, max_width=300) == (1, 300)  # the model's limit is a bucket
    assert bucket(1, 40, max_width=40) == (1, 40)


def test_large_batches_run_eagerly() -> None:
    assert bucket(65, 10, max_width=512) is None  # more inputs than the largest bucket
    assert bucket(32, 200, max_width=512) is None  # 32 x 224 padded tokens: over the limit
    assert bucket(1, 513, max_width=512) is None  # longer than the model takes


def test_every_bucket_is_captured_once_and_within_the_limit() -> None:
    shapes = all_buckets(max_width=256)
    assert len(shapes) == len(set(shapes))
    assert all(rows * width <= GRAPH_MAX_TOKENS for rows, width in shapes)
    assert (1, 256) in shapes and (64, 64) in shapes and (64, 96) not in shapes
    sizes = [rows * width for rows, width in shapes]
    assert sizes == sorted(sizes, reverse=True)  # the largest first: the pool is sized once
    assert all(bucket(rows, width, 256) == (rows, width) for rows, width in shapes)


def test_padding_rows_hold_one_token_and_columns_are_masked() -> None:
    grid, mask, prompts = padded_batch([[5, 6, 7], [8]], [1, 0], (4, 32), pad_id=0)
    assert grid.shape == mask.shape == (4, 32) and prompts.tolist() == [1, 0, 0, 0]
    assert grid[0, :4].tolist() == [5, 6, 7, 0] and grid[1, :2].tolist() == [8, 0]
    assert mask.sum(axis=1).tolist() == [3, 1, 1, 1]  # the extra rows: one pad token each
    assert (grid[2:] == 0).all()


@pytest.mark.parametrize("count", [1, ROW_BY_ROW, ROW_BY_ROW + 1, 40])
def test_row_by_row_and_whole_array_padding_agree(count: int) -> None:
    """A graph's inputs are written into pinned buffers that earlier batches filled, the
    three arrays views of one buffer (one copy to the GPU). Small batches are padded row by
    row, larger ones in whole-array steps: both give what padding each row by hand gives,
    over stale values, empty inputs included."""
    rows, width = 64, 32
    ids = [list(range(1, 1 + (row * 7) % width)) for row in range(count)]
    prompts = [row % 3 for row in range(count)]
    flat = np.full(input_values((rows, width)), 99, dtype=np.int64)
    grid, mask, written = inputs_in(flat, (rows, width))
    assert all(np.shares_memory(array, flat) for array in (grid, mask, written))
    write_padded(ids, prompts, 5, grid, mask, written)
    for row in range(rows):
        tokens = ids[row] if row < count else []
        assert grid[row].tolist() == tokens + [5] * (width - len(tokens))
        real = len(tokens) if row < count else 1  # a padding row holds one pad token
        assert mask[row].tolist() == [1] * real + [0] * (width - real)
    assert written.tolist() == prompts + [0] * (rows - count)


def test_padding_to_a_bucket_leaves_the_real_rows_alone(tiny_embedder: Embedder) -> None:
    """What a graph computes, run eagerly: the batch's rows padded to its bucket give the
    vectors the batch gives at its own shape (float32, max abs difference 1e-5)."""
    ids = [e.ids for e in tiny_embedder.tokenize(TEXTS)]
    width = max(len(row) for row in ids)
    shape = bucket(len(ids), width, tiny_embedder.info.max_input_tokens)
    assert shape is not None and shape[0] > len(ids) and shape[1] > width
    pad = tiny_embedder.network.config.pad_token_id

    def vectors(shape: tuple[int, int]) -> torch.Tensor:
        arrays = padded_batch(ids, [0] * len(ids), shape, pad)
        grid, mask, prompts = (torch.from_numpy(array) for array in arrays)
        with torch.inference_mode():
            return tiny_embedder.pooled_forward(grid, mask, prompts)

    padded = vectors(shape)
    assert torch.isfinite(padded).all()
    assert (padded[: len(ids)] - vectors((len(ids), width))).abs().max() <= 1e-5
    assert (padded[: len(ids)] - tiny_embedder.forward(ids).pooled).abs().max() <= 1e-5


def test_no_graphs_on_the_cpu(tiny_embedder: Embedder) -> None:
    assert tiny_embedder.graphs is None
    assert tiny_embedder.capture_graphs() == 0
