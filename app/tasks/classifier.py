"""Classifiers (cross-encoders): one raw logit per label; /rerank needs exactly one label."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.engine.protocol import Output, Wants
from app.tasks import TaskSpec
from model.info import ModelInfo, Task
from model.vectors import FloatArray


def finish_logits(pooled: FloatArray, wants: Sequence[Wants]) -> list[Output | None]:
    return [pooled[row].copy() if wanted.pooled else None for row, wanted in enumerate(wants)]


def probabilities(logits: FloatArray, raw: bool) -> FloatArray:
    """text-embeddings-inference's scores: a sigmoid of one logit, a softmax of several."""
    if raw:
        return logits
    scores: FloatArray
    if logits.shape[-1] == 1:
        scores = np.reciprocal(1 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = shifted / shifted.sum(axis=-1, keepdims=True)
    return scores.astype(np.float32, copy=False)


def is_reranker(info: ModelInfo) -> bool:
    return len(info.labels) == 1


def main_path(info: ModelInfo, raw: bytes) -> str:
    return "/rerank" if is_reranker(info) else "/predict"


def tei_model_type(info: ModelInfo) -> dict[str, dict[str, object]]:
    id2label = {str(index): label for index, label in enumerate(info.labels)}
    label2id = {label: int(index) for index, label in id2label.items()}
    kind = "reranker" if is_reranker(info) else "classifier"
    return {kind: {"id2label": id2label, "label2id": label2id}}


SPEC = TaskSpec(
    Task.CLASSIFY,
    "a classifier",
    frozenset({"/predict", "/rerank"}),
    main_path,
    tei_model_type,
    finish_logits,
)
