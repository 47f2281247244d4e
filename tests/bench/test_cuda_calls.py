"""bench.cuda_calls times each CUDA call of a graphed pass (skipped where there is no GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.cuda_calls import pass_calls, timed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_every_call_is_timed() -> None:
    """Each call runs (a failing one raises) and takes a finite, non-zero time."""
    for call in pass_calls().values():
        best, median = timed(call, calls=20, rounds=2)
        assert best > 0 and math.isfinite(median)
