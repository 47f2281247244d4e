"""Cross-encoders, as text-embeddings-inference serves them: POST /predict and POST /rerank."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.responses import JSONResponse, timing_headers
from app.routes.errors import error_responses
from app.schemas import Prediction, PredictRequest, Rank, RerankRequest
from model import FloatArray, Task

router = APIRouter(tags=["text-embeddings-inference"], responses=error_responses())


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


@router.post(
    "/predict",
    response_model=list[Prediction] | list[list[Prediction]],
    summary="Labels and scores of texts or text pairs (sequence classification)",
)
async def predict(
    body: PredictRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    result = await service.encode(body.inputs_list(), body.options(), disconnected, Task.CLASSIFY)
    labels = result.model.labels
    answers = []
    for item in result.items:
        assert item.scores is not None, "a classifier gives scores"
        scores = probabilities(item.scores, body.raw_scores)
        ranked = sorted(zip(scores.tolist(), labels, strict=True), reverse=True)
        answers.append([{"score": score, "label": label} for score, label in ranked])
    content = answers if body.is_batch() else answers[0]
    return JSONResponse(content, headers=timing_headers(result))


@router.post(
    "/rerank",
    response_model=list[Rank],
    summary="Texts ranked by their relevance to a query (a cross-encoder with one label)",
)
async def rerank(body: RerankRequest, service: ServiceDep, disconnected: DisconnectDep) -> Response:
    service.check_reranker()
    result = await service.encode(body.pairs(), body.options(), disconnected, Task.CLASSIFY)
    logits = np.array([item.scores[0] for item in result.items if item.scores is not None])
    scores = probabilities(logits[:, None], body.raw_scores)[:, 0]
    order = np.argsort(-scores, kind="stable")
    ranks = [
        {"index": int(index), "score": float(scores[index])}
        | ({"text": body.texts[index]} if body.return_text else {})
        for index in order
    ]
    return JSONResponse(ranks, headers=timing_headers(result))
