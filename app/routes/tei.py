"""text-embeddings-inference compatible routes: /embed, /embed_all, /similarity, /tokenize,
/decode, and `POST /`, its alias for the model's main task."""

from __future__ import annotations

import json
from typing import TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.errors import require_json
from app.responses import JSONResponse, render, timing_headers
from app.routes import classify, sparse
from app.routes.errors import error_responses
from app.schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
    SimpleToken,
    TokenizeRequest,
)
from model import Task

router = APIRouter(tags=["text-embeddings-inference"], responses=error_responses())


@router.post("/embed", response_model=list[list[float]], summary="Pooled embeddings")
async def embed(body: EmbedRequest, service: ServiceDep, disconnected: DisconnectDep) -> Response:
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
    return JSONResponse(result.vectors(), headers=timing_headers(result))


@router.post(
    "/embed_all",
    response_model=list[list[list[float]]],
    summary="Per-token embeddings (special tokens included, no padding)",
)
async def embed_all(
    body: EmbedAllRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    # Per-token states: every kind of model has them.
    result = await service.encode(body.inputs_list(), body.options(), disconnected, task=None)
    values = result.token_count * result.model.hidden_size
    return await render(
        lambda: [item.token_embeddings for item in result.items],
        values=values,
        headers=timing_headers(result),
    )


@router.post(
    "/similarity",
    response_model=list[float],
    summary="Scores of sentences against a source sentence (the model's similarity function)",
)
async def similarity(
    body: SimilarityRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    scores, result = await service.similarity(
        body.inputs.source_sentence, body.inputs.sentences, body.options(), disconnected
    )
    return JSONResponse(scores, headers=timing_headers(result))


@router.post("/tokenize", response_model=list[list[SimpleToken]], summary="Tokens with offsets")
async def tokenize(body: TokenizeRequest, service: ServiceDep) -> Response:
    tokenized = await service.tokenize(
        body.inputs_list(), body.options(), add_special_tokens=body.add_special_tokens
    )
    response = []
    for source, item in zip(tokenized.texts, tokenized.encoded, strict=True):
        tokens = []
        for position, (token_id, token) in enumerate(zip(item.ids, item.tokens, strict=True)):
            special = item.special[position]
            start, stop = item.offsets[position] if item.offsets and not special else (None, None)
            text = source[start:stop] if isinstance(source, str) and start is not None else token
            tokens.append(
                {"id": token_id, "text": text, "special": special, "start": start, "stop": stop}
            )
        response.append(tokens)
    return JSONResponse(response)


@router.post("/decode", response_model=list[str], summary="Token ids back to text")
async def decode(body: DecodeRequest, service: ServiceDep) -> Response:
    texts = service.decode(body.ids_list(), skip_special_tokens=body.skip_special_tokens)
    return JSONResponse(texts)


@router.post("/", include_in_schema=False)
async def main_task(request: Request, service: ServiceDep, disconnected: DisconnectDep) -> Response:
    """text-embeddings-inference's alias for the model's main task, which huggingface_hub's
    InferenceClient calls when it is given a base URL: /rerank for a reranker, /predict for
    another classifier, /embed_sparse for a sparse model; for an embedding model /similarity
    when the body is {"inputs": {source_sentence, sentences}} (what its sentence_similarity
    sends), else /embed."""
    raw = await request.body()
    require_json(request.headers.get("content-type", ""))
    info = service.info
    if info.task is Task.CLASSIFY and len(info.labels) == 1:
        return await classify.rerank(parse(RerankRequest, raw), service, disconnected)
    if info.task is Task.CLASSIFY:
        return await classify.predict(parse(PredictRequest, raw), service, disconnected)
    if info.task is Task.SPARSE:
        return await sparse.embed_sparse(parse(EmbedSparseRequest, raw), service, disconnected)
    if _inputs_is_an_object(raw):
        return await similarity(parse(SimilarityRequest, raw), service, disconnected)
    return await embed(parse(EmbedRequest, raw), service, disconnected)


def _inputs_is_an_object(raw: bytes) -> bool:
    """{"inputs": {...}} can only be a similarity body: its errors are then /similarity's."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False  # /embed's parser says it is not JSON
    return isinstance(body, dict) and isinstance(body.get("inputs"), dict)


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], raw: bytes) -> Model:
    """Validate a body by hand, with the same errors FastAPI's own validation gives."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc
    if any(e["type"] == "json_invalid" for e in error.errors()):
        # pydantic's parser refuses what FastAPI's json.loads takes (a lone surrogate, whose
        # error says so): validate that, so that the errors are the same.
        try:
            return model.model_validate(json.loads(raw))
        except ValidationError as again:
            error = again
        except ValueError:  # not JSON to either parser
            pass
    errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors()]
    raise RequestValidationError(errors) from error
