"""text-embeddings-inference compatible routes: /embed, /embed_all, /similarity, /tokenize,
/decode (its `POST /`, the alias for the model's main task, is app/dispatch.py's)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.responses import JSONResponse, encoded_vectors, render, timing_headers
from app.routes.errors import error_responses
from app.schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    SimilarityRequest,
    SimpleToken,
    TokenizeRequest,
)

router = APIRouter(tags=["text-embeddings-inference"], responses=error_responses())


@router.post(
    "/embed",
    response_model=list[list[float]] | list[list[int]] | list[str],
    summary="Pooled embeddings",
)
async def embed(body: EmbedRequest, service: ServiceDep, disconnected: DisconnectDep) -> Response:
    options = body.options()
    result = await service.encode(body.inputs_list(), options, disconnected)
    vectors = encoded_vectors(result.vectors(), body.encoding, service, options)
    return JSONResponse(vectors, headers=timing_headers(result))


@router.post(
    "/embed_all",
    response_model=list[list[list[float]]],
    summary="Per-token embeddings (special tokens included, no padding)",
)
async def embed_all(
    body: EmbedAllRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
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
async def tokenize(body: TokenizeRequest, service: ServiceDep, _: DisconnectDep) -> Response:
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
async def decode(body: DecodeRequest, service: ServiceDep, _: DisconnectDep) -> Response:
    texts = await service.decode(body.ids_list(), skip_special_tokens=body.skip_special_tokens)
    return JSONResponse(texts)
