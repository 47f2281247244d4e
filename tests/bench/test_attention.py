"""bench.attention compares the flash kernel with every score at once, alone and in the model."""

from __future__ import annotations

import functools
import re
import sys

import pytest

from bench import attention
from bench.workload import long_passages


def test_it_prints_a_ratio_per_cell_and_per_load_the_medians_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(attention, "BATCHES", (1, 4))
    monkeypatch.setattr(attention, "WIDTHS", (8, 16, 64))
    # Passages of about 60 tokens: still past the limit, in a fraction of the time.
    monkeypatch.setattr(attention, "long_passages", functools.partial(long_passages, words=50))
    argv = ["attention", "--threads", "2", "--dtypes", "float32", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    attention.main()
    out = capsys.readouterr().out
    grids = re.findall(r"^B +\d+((?: +[\d.]+)+)$", out, re.MULTILINE)
    assert len(grids) == 4  # two batch sizes on one thread, then on two
    assert all(len(cells.split()) == 3 for cells in grids)
    loads = re.findall(r"(\w+ \w+): as it is ([\d.]+), flash always ([\d.]+); .* ([\d.]+)x", out)
    # On one thread, then on two.
    assert [load for load, *_ in loads] == ["32 short", "1 short", "8 long"] * 2
    for _, as_it_is, flash, ratio in loads:
        assert float(ratio) == pytest.approx(float(as_it_is) / float(flash), abs=0.01)
