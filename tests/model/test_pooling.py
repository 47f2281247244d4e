from __future__ import annotations

import pytest
import torch

from model import ConfigError, Pooling, finalize
from model.pooling import pool, pooling_from_config

HIDDEN = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [100.0, 100.0]]])  # third token is padding
MASK = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (Pooling.MEAN, [2.0, -1.0]),
        (Pooling.CLS, [1.0, 2.0]),
        (Pooling.MAX, [3.0, 2.0]),
        (Pooling.LAST_TOKEN, [3.0, -4.0]),
    ],
)
def test_pooling_ignores_padding(mode: Pooling, expected: list[float]) -> None:
    assert pool(HIDDEN, MASK, mode).tolist() == [expected]


def test_max_pooling_of_an_empty_input_is_zero() -> None:
    assert pool(HIDDEN, torch.zeros_like(MASK), Pooling.MAX).tolist() == [[0.0, 0.0]]


def test_finalize_truncates_then_normalises() -> None:
    vectors = torch.tensor([[3.0, 4.0, 12.0]])
    assert finalize(vectors, normalize=False, dimensions=2).tolist() == [[3.0, 4.0]]
    assert torch.allclose(
        finalize(vectors, normalize=True, dimensions=2), torch.tensor([[0.6, 0.8]])
    )
    assert torch.allclose(finalize(vectors, normalize=True).norm(dim=-1), torch.tensor([1.0]))


def test_pooling_config_flags() -> None:
    assert pooling_from_config({"pooling_mode_cls_token": True}, "f") is Pooling.CLS
    assert pooling_from_config({"pooling_mode_lasttoken": True}, "f") is Pooling.LAST_TOKEN
    with pytest.raises(ConfigError, match="exactly one"):
        pooling_from_config({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "f")
    with pytest.raises(ConfigError, match="pooling_mode_weightedmean_tokens"):
        pooling_from_config({"pooling_mode_weightedmean_tokens": True}, "f")
