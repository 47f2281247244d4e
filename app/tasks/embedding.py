"""Embedding models: pooled vectors, cut and normalised as each request asks."""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from app.engine.protocol import Output, Wants
from app.errors import ServiceError
from app.parsing import read_json
from app.tasks import TaskSpec
from model.info import ModelInfo, Task
from model.vectors import FloatArray, finish


def finish_vectors(pooled: FloatArray, wants: Sequence[Wants]) -> list[Output | None]:
    """Each row's vector cut and normalised as its request asks: one numpy call per distinct
    (normalize, dimensions) in the batch, not one per row."""
    groups: dict[tuple[bool, int | None], list[int]] = {}
    for row, wanted in enumerate(wants):
        if wanted.pooled:
            groups.setdefault((wanted.normalize, wanted.dimensions), []).append(row)
    if len(groups) == 1:
        [((normalize, dimensions), rows)] = groups.items()
        if len(rows) == len(wants):  # the common batch: every row alike, one call in all
            return list(finish(pooled, normalize, dimensions))
    done: list[Output | None] = [None] * len(wants)
    for (normalize, dimensions), rows in groups.items():
        for row, vector in zip(rows, finish(pooled[rows], normalize, dimensions), strict=True):
            done[row] = vector
    return done


def main_path(info: ModelInfo, raw: bytes) -> str:
    """/similarity when the body is {"inputs": {...}} (what huggingface_hub's
    sentence_similarity sends; its errors are then /similarity's), else /embed."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            body = read_json(raw)  # a byte order mark, a lone surrogate: read as the parser does
        except ServiceError:
            return "/embed"  # whose parser says it is not JSON
    similarity = isinstance(body, dict) and isinstance(body.get("inputs"), dict)
    return "/similarity" if similarity else "/embed"


def tei_model_type(info: ModelInfo) -> dict[str, dict[str, object]]:
    return {"embedding": {"pooling": "+".join(info.pooling)}}


SPEC = TaskSpec(
    Task.EMBED,
    "an embedding",
    frozenset(
        {"/embed", "/embed_chunks", "/similarity", "/v1/embeddings", "/embeddings", "/v2/embed"}
    ),
    main_path,
    tei_model_type,
    finish_vectors,
    codes=True,
)
