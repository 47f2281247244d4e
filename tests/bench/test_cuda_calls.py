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
    timings = {name: timed(call, calls=20, rounds=2) for name, call in pass_calls().items()}
    assert len(timings) == 8
    for best, median in timings.values():
        assert 0 < best <= median and math.isfinite(median)
