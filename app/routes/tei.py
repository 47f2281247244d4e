"""text-embeddings-inference compatible routes: /embed, /embed_all, /tokenize."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends

from app.dependencies import DisconnectDep, ServiceDep, require_api_key
from app.responses import JSONResponse, pooled_vectors, timing_headers
from app.routes.errors import error_responses
from app.schemas import EmbedAllRequest, EmbedRequest, SimpleToken, TokenizeRequest

router = APIRouter(
    tags=["text-embeddings-inference"],
    dependencies=[Depends(require_api_key)],
    responses=error_responses(),
)


@router.post("/embed", response_model=list[list[float]], summary="Pooled embeddings")
async def embed(
    body: EmbedRequest, service: ServiceDep, disconnected: DisconnectDep
) -> JSONResponse:
    service.validate_dimensions(body.dimensions)
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
    vectors = pooled_vectors(result, body.normalize, body.dimensions)
    return JSONResponse(vectors, headers=timing_headers(result))


@router.post(
    "/embed_all",
    response_model=list[list[list[float]]],
    summary="Per-token embeddings (special tokens included, no padding)",
)
async def embed_all(
    body: EmbedAllRequest, service: ServiceDep, disconnected: DisconnectDep
) -> JSONResponse:
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
    vectors = [np.ascontiguousarray(item.token_embeddings) for item in result.items]
    return JSONResponse(vectors, headers=timing_headers(result))


@router.post("/tokenize", response_model=list[list[SimpleToken]], summary="Tokens with offsets")
async def tokenize(body: TokenizeRequest, service: ServiceDep) -> JSONResponse:
    inputs = body.inputs_list()
    encoded = await service.tokenize(
        inputs, body.options(), add_special_tokens=body.add_special_tokens
    )
    response = []
    for source, item in zip(inputs, encoded, strict=True):
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
