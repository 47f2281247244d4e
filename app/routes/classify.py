"""Cross-encoders, as text-embeddings-inference serves them: POST /predict and POST /rerank."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.errors import WrongTaskError
from app.responses import JSONResponse, timing_headers
from app.routes.errors import error_responses
from app.schemas import Prediction, PredictRequest, Rank, RerankRequest
from app.tasks.classifier import is_reranker, probabilities

router = APIRouter(tags=["text-embeddings-inference"], responses=error_responses())


@router.post(
    "/predict",
    response_model=list[Prediction] | list[list[Prediction]],
    summary="Labels and scores of texts or text pairs (sequence classification)",
)
async def predict(
    body: PredictRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
    labels = result.model.labels
    answers = []
    for item in result.items:
        scores = probabilities(item.vector, body.raw_scores)
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
    if not is_reranker(info := service.info):
        raise WrongTaskError(
            f"this route needs a reranker (a classifier with one label); the loaded model "
            f"has {len(info.labels)} labels: use /predict"
        )
    result = await service.encode(body.pairs(), body.options(), disconnected)
    logits = np.array([item.vector[0] for item in result.items])
    scores = probabilities(logits[:, None], body.raw_scores)[:, 0]
    order = np.argsort(-scores, kind="stable")
    ranks = [
        {"index": int(index), "score": float(scores[index])}
        | ({"text": body.texts[index]} if body.return_text else {})
        for index in order
    ]
    return JSONResponse(ranks, headers=timing_headers(result))
