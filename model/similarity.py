"""Scores between embeddings, by the similarity function the model folder names.

sentence-transformers' `similarity_fn_name` (config_sentence_transformers.json): cosine (the
default), dot, and the negated euclidean and manhattan distances, so that higher is more
similar in every case.
"""

from __future__ import annotations

import numpy as np

from model.errors import ConfigError
from model.vectors import FloatArray

SIMILARITY_FUNCTIONS = ("cosine", "dot", "euclidean", "manhattan")


def check_similarity_fn(name: str, source: str) -> None:
    if name not in SIMILARITY_FUNCTIONS:
        raise ConfigError(
            f"{source}: unsupported similarity_fn_name {name!r} "
            f"(supported: {', '.join(SIMILARITY_FUNCTIONS)})"
        )


def similarity(query: FloatArray, others: FloatArray, name: str = "cosine") -> FloatArray:
    """(D,) against (N, D) -> (N,) float32 scores."""
    scores: FloatArray
    if name == "dot":
        scores = others @ query
    elif name == "euclidean":
        scores = -np.linalg.norm(others - query, axis=1)
    elif name == "manhattan":
        scores = -np.abs(others - query).sum(axis=1)
    else:
        norms = np.maximum(np.linalg.norm(others, axis=1) * np.linalg.norm(query), 1e-12)
        scores = (others @ query) / norms
    return scores.astype(np.float32, copy=False)
