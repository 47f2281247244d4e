"""Compact codes (model/quantization.py) against sentence-transformers' quantize_embeddings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from model.errors import ConfigError
from model.quantization import (
    PRECISIONS,
    Calibration,
    builtin_calibration_texts,
    quantize,
    read_calibration_file,
)
from model.vectors import finish


def vectors(rows: int, dimension: int = 32, seed: int = 0) -> np.ndarray:
    generator = np.random.default_rng(seed)
    return generator.standard_normal((rows, dimension)).astype(np.float32)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_codes_are_those_of_sentence_transformers_bit_for_bit(precision: str) -> None:
    calibration = Calibration(vectors(200))
    ranges = calibration.ranges(normalize=True, dimensions=None)
    inside = finish(vectors(200), True)[:50]  # calibration vectors: inside the ranges
    ours = quantize(inside, precision, ranges)  # type: ignore[arg-type]
    theirs = quantize_embeddings(inside, precision=precision, ranges=ranges)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def test_values_outside_the_ranges_saturate() -> None:
    ranges = np.array([[-1.0, 0.0], [1.0, 2.0]], dtype=np.float32)
    far = np.array([[-5.0, 9.0], [3.0, -4.0]], dtype=np.float32)
    assert quantize(far, "int8", ranges).tolist() == [[-128, 127], [127, -128]]
    assert np.array_equal(
        quantize(far, "int8", ranges), quantize_embeddings(far, precision="int8", ranges=ranges)
    )
    assert quantize(far, "uint8", ranges).tolist() == [[0, 255], [255, 0]]


def test_binary_codes_keep_the_sign_bits_most_significant_first() -> None:
    signs = np.array([[1, -1, -1, -1, -1, -1, -1, 1] * 2], dtype=np.float32)
    assert quantize(signs, "ubinary", signs).tolist() == [[0b10000001] * 2]
    assert quantize(signs, "binary", signs).tolist() == [[0b10000001 - 128] * 2]


def test_ranges_describe_the_vectors_finished_as_the_request_asks() -> None:
    raw = vectors(100)
    calibration = Calibration(raw)
    cut = calibration.ranges(normalize=True, dimensions=8)
    expected = finish(raw, True, 8)
    assert cut.shape == (2, 8)
    assert np.array_equal(cut[0], expected.min(axis=0))
    assert np.array_equal(cut[1], expected.max(axis=0))
    unnormalised = calibration.ranges(normalize=False, dimensions=None)
    assert np.array_equal(unnormalised[1], raw.max(axis=0))
    assert calibration.ranges(normalize=True, dimensions=8) is cut  # computed once


def test_a_dimension_constant_over_the_calibration_set_gets_one_code() -> None:
    ranges = np.array([[0.5, -1.0], [0.5, 1.0]], dtype=np.float32)
    codes = quantize(np.array([[0.5, 0.0]], dtype=np.float32), "uint8", ranges)
    assert codes.tolist() == [[0, 127]]  # 0.0 is 127.5 steps from -1: its floor


def test_calibration_texts_builtin_and_from_a_file(tmp_path: Path) -> None:
    builtin = builtin_calibration_texts()
    assert len(builtin) >= 64 and len(set(builtin)) == len(builtin)
    file = tmp_path / "texts.txt"
    file.write_text("first text\n\n  \nsecond text\n", encoding="utf-8")
    assert read_calibration_file(file) == ["first text", "second text"]
    file.write_text("only one\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="needs 2 to 10000 non-blank lines, has 1"):
        read_calibration_file(file)
    with pytest.raises(ConfigError, match="calibration file"):
        read_calibration_file(tmp_path / "missing.txt")
