"""Compact vectors chosen per request: int8, uint8, binary and ubinary, with
sentence-transformers' `quantize_embeddings` semantics.

int8 and uint8 map each dimension's range onto 256 steps. The ranges come from a calibration
set embedded once at start-up (a built-in list of varied sentences, or the operator's file),
never from the request or its batch: a vector's codes must not depend on what else was sent.
A vector is finished first (cut to `dimensions`, normalised as asked), and so are the
calibration vectors, so that the ranges describe what is quantized. Values outside a range
saturate at its ends. binary and ubinary keep the sign bits, eight to a byte per vector
(numpy's `packbits`, most significant bit first); binary then shifts the bytes by -128 into
int8. All as sentence-transformers 6 computes them, bit for bit (tests/model/test_quantization.py).

No torch here: the front ends import it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from model.errors import ConfigError
from model.vectors import FloatArray, finish

Precision = Literal["int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[Precision, ...] = ("int8", "uint8", "binary", "ubinary")
CodeArray = npt.NDArray[np.int8] | npt.NDArray[np.uint8]

# The built-in calibration set: every combination of these, and the questions, sentences of
# varied subjects, lengths and registers.
_OPENINGS = (
    "The committee approved the budget",
    "A small dog ran across the park",
    "Quantum computers use qubits",
    "The recipe needs two cups of flour",
    "Stock markets fell sharply on Monday",
    "She plays the violin in an orchestra",
    "The patient reported a mild headache",
    "Rainfall was heavy in the northern region",
    "The database query returned no rows",
    "Children learn languages quickly",
    "The museum opens a new exhibition",
    "Our flight was delayed by three hours",
)
_CLOSINGS = (
    "",
    " after a long debate.",
    " because nobody expected it.",
    " and everyone was surprised?",
    ", according to the latest report from the agency.",
    " — read the full story, with charts and interviews, on page four of the weekend edition.",
)
_QUESTIONS = (
    "What is the capital of France?",
    "How do I reset my password",
    "best pizza near me",
    "Why is the sky blue",
    "symptoms of the flu in adults",
    "convert 10 miles to km",
    "python list comprehension example",
    "who wrote pride and prejudice",
)


def builtin_calibration_texts() -> list[str]:
    sentences = [opening + closing for opening, closing in itertools.product(_OPENINGS, _CLOSINGS)]
    return sentences + list(_QUESTIONS)


# A calibration file's most texts: every front end holds their vectors.
MAX_CALIBRATION_TEXTS = 10_000


def read_calibration_file(path: Path) -> list[str]:
    """One text per line, blank lines skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"calibration file {path}: {exc}") from exc
    texts = [line for line in lines if line.strip()]
    if not 2 <= len(texts) <= MAX_CALIBRATION_TEXTS:
        raise ConfigError(
            f"calibration file {path}: needs 2 to {MAX_CALIBRATION_TEXTS} non-blank lines, "
            f"has {len(texts)}"
        )
    return texts


class Calibration:
    """The model's own vectors of the calibration texts, as the pipeline gives them; the
    ranges of each way of finishing them, computed once each."""

    def __init__(self, vectors: FloatArray) -> None:
        self.vectors = vectors
        self._ranges: dict[tuple[bool, int | None], FloatArray] = {}

    def ranges(self, normalize: bool, dimensions: int | None) -> FloatArray:
        """(2, D) float32: each dimension's minimum, then maximum."""
        key = (normalize, dimensions)
        if key not in self._ranges:
            finished = finish(self.vectors, normalize, dimensions)
            self._ranges[key] = np.stack([finished.min(axis=0), finished.max(axis=0)])
        return self._ranges[key]


def quantize(vectors: FloatArray, precision: Precision, ranges: FloatArray) -> CodeArray:
    """(N, D) finished float32 vectors -> (N, D) int8/uint8 codes, or (N, ceil(D / 8))
    packed sign bits."""
    if precision in ("binary", "ubinary"):
        bits = np.packbits(vectors > 0, axis=-1)
        return (bits - 128).astype(np.int8) if precision == "binary" else bits
    starts = ranges[0]
    steps = (ranges[1] - starts) / 255
    # A dimension constant over the calibration set has no range: a step of 1 keeps its code.
    steps = np.where(steps == 0, 1, steps)
    steps_from_start = np.clip(np.floor((vectors - starts) / steps), 0, 255)
    if precision == "uint8":
        unsigned: npt.NDArray[np.uint8] = steps_from_start.astype(np.uint8)
        return unsigned
    signed: npt.NDArray[np.int8] = (steps_from_start - 128).astype(np.int8)
    return signed
