"""bench.tokenizing times the served tokenizer with its plain ASCII twin and without."""

from __future__ import annotations

import sys

import pytest

from bench import tokenizing


def test_it_prints_both_medians_and_their_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["tokenizing", "--blocks", "4", "--sentences", "3"])
    tokenizing.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["with", "without", "with"]
    with_twin, without = (float(line.split("median")[1].split()[0]) for line in lines[:2])
    ratio = float(lines[-1].rsplit(" ", 1)[1].rstrip("x"))
    assert ratio == pytest.approx(with_twin / without, abs=0.02)
