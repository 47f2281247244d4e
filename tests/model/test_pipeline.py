"""Pooling modes, the prompt exclusion, Dense layers and the final cut, on hand-made numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model import Embedder, PoolingMode, finish
from model import embedder as embedder_module
from model.pipeline import Dense, DenseSpec, EmbeddingPipeline, Normalize, Pooling

HIDDEN = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [5.0, 0.0], [100.0, 100.0]]])  # last: padding
MASK = torch.tensor([[1, 1, 1, 0]])
NO_PROMPT = torch.tensor([0])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (PoolingMode.MEAN, [3.0, -2 / 3]),
        (PoolingMode.CLS, [1.0, 2.0]),
        (PoolingMode.MAX, [5.0, 2.0]),
        (PoolingMode.LAST_TOKEN, [5.0, 0.0]),
        (PoolingMode.MEAN_SQRT_LEN, [9.0 / 3**0.5, -2.0 / 3**0.5]),
        # weights 1, 2, 3 by position
        (PoolingMode.WEIGHTED_MEAN, [(1 + 6 + 15) / 6, (2 - 8 + 0) / 6]),
    ],
)
def test_each_mode_ignores_padding(mode: PoolingMode, expected: list[float]) -> None:
    got = Pooling((mode,))(HIDDEN, MASK, NO_PROMPT)
    assert torch.allclose(got, torch.tensor([expected]), atol=1e-6)


def test_modes_concatenate_in_the_order_given() -> None:
    got = Pooling((PoolingMode.CLS, PoolingMode.MEAN))(HIDDEN, MASK, NO_PROMPT)
    assert torch.allclose(got, torch.tensor([[1.0, 2.0, 3.0, -2 / 3]]))


def test_excluded_prompt_is_left_out_and_keeps_positions() -> None:
    prompt = torch.tensor([1])  # the first token is the prompt's (with its special token)
    mean = Pooling((PoolingMode.MEAN,), include_prompt=False)(HIDDEN, MASK, prompt)
    assert torch.allclose(mean, torch.tensor([[4.0, -2.0]]))
    cls = Pooling((PoolingMode.CLS,), include_prompt=False)(HIDDEN, MASK, prompt)
    assert torch.allclose(cls, torch.tensor([[3.0, -4.0]]))  # the first token kept
    weighted = Pooling((PoolingMode.WEIGHTED_MEAN,), include_prompt=False)(HIDDEN, MASK, prompt)
    assert torch.allclose(weighted, torch.tensor([[(6 + 15) / 5, -8 / 5]]))
    kept = Pooling((PoolingMode.MEAN,), include_prompt=True)(HIDDEN, MASK, prompt)
    assert torch.allclose(kept, torch.tensor([[3.0, -2 / 3]]))


def test_an_input_with_nothing_to_pool_gives_finite_zeros() -> None:
    for mode in PoolingMode:
        got = Pooling((mode,))(HIDDEN, torch.zeros_like(MASK), NO_PROMPT)
        assert torch.isfinite(got).all(), mode


def test_half_precision_states_pool_in_float32() -> None:
    # 300 tokens of 1000: a float16 sum of them would be inf.
    hidden = torch.full((1, 300, 2), 1000.0, dtype=torch.float16)
    got = Pooling((PoolingMode.MEAN,))(hidden, torch.ones(1, 300, dtype=torch.long), NO_PROMPT)
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.tensor([[1000.0, 1000.0]]))


def test_dense_and_normalize_steps_run_in_order() -> None:
    dense = Dense(DenseSpec(in_features=2, out_features=3, activation="Identity"))
    with torch.no_grad():
        dense.linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        dense.linear.bias.zero_()
    pipeline = EmbeddingPipeline(Pooling((PoolingMode.CLS,)), [Normalize(), dense], normalize=True)
    got = pipeline(HIDDEN, MASK, NO_PROMPT)
    unit = torch.tensor([1.0, 2.0]) / 5**0.5
    assert torch.allclose(got, torch.tensor([[unit[0], unit[1], unit.sum()]]))
    assert pipeline.dimensions(hidden_size=2) == 3 and pipeline.normalize


def test_residual_dense_adds_its_input() -> None:
    dense = Dense(DenseSpec(in_features=2, out_features=2, activation="Tanh", use_residual=True))
    x = torch.tensor([[0.5, -1.0]])
    assert torch.allclose(dense(x), torch.tanh(dense.linear(x)) + x)


def test_finish_cuts_then_normalises() -> None:
    vectors = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    assert finish(vectors, normalize=False, dimensions=2).tolist() == [[3.0, 4.0]]
    assert np.allclose(finish(vectors, normalize=True, dimensions=2), [[0.6, 0.8]])
    assert np.allclose(np.linalg.norm(finish(vectors, normalize=True)), 1.0)
    assert finish(np.zeros((1, 3), dtype=np.float32), normalize=True).tolist() == [[0.0] * 3]


def test_late_chunks_pool_alike_in_one_grid_and_in_groups(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans pooled a few at a time (a small grid budget) equal spans pooled together."""
    states = np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32)
    spans = [(0, 7), (5, 19), (19, 20), (20, 40), (3, 33)]
    together = tiny_embedder.pool_spans(states, spans)
    monkeypatch.setattr(embedder_module, "POOL_GRID_VALUES", 30 * 32 * 2)  # two rows a group
    grouped = tiny_embedder.pool_spans(states, spans)
    np.testing.assert_allclose(grouped, together, atol=1e-6)
    assert np.allclose(together[0], states[0:7].mean(axis=0), atol=1e-5)
