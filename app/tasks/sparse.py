"""Sparse (SPLADE) models: a weight per vocabulary entry, handed on as the ids it weighs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.engine.protocol import Output, Wants
from app.tasks import TaskSpec
from model.info import ModelInfo, Task
from model.vectors import FloatArray


def finish_sparse(pooled: FloatArray, wants: Sequence[Wants]) -> list[Output | None]:
    done: list[Output | None] = []
    for row, wanted in enumerate(wants):
        ids = np.flatnonzero(pooled[row]) if wanted.pooled else None
        done.append((ids, pooled[row][ids]) if ids is not None else None)
    return done


def main_path(info: ModelInfo, raw: bytes) -> str:
    return "/embed_sparse"


def tei_model_type(info: ModelInfo) -> dict[str, dict[str, object]]:
    return {"embedding": {"pooling": "splade"}}


SPEC = TaskSpec(
    Task.SPARSE,
    "a sparse",
    frozenset({"/embed_sparse"}),
    main_path,
    tei_model_type,
    finish_sparse,
)
