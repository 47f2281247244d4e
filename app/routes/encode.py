"""POST /encode: pooled and per-token vectors, tokens with offsets, and attention maps; and
POST /embed_chunks: long texts' chunks, each with its vector and offsets."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.engine.protocol import ItemResult
from app.errors import ValidationFailedError
from app.params import ChunkOptions
from app.responses import (
    Encoding,
    array_payload,
    encoded_vectors,
    render,
    timing_headers,
    usage_payload,
)
from app.routes.errors import error_responses
from app.schemas import ChunkRequest, ChunkVector, EncodeRequest, EncodeResponse
from app.service import ChunkedResult, EncodeResult
from app.tasks import require_task
from model import Encoded, FloatArray
from model.quantization import CodeArray

router = APIRouter(tags=["encode"], responses=error_responses())


def token_payload(encoded: Encoded) -> list[dict[str, Any]]:
    offsets: list[tuple[int, int]] | list[tuple[None, None]] = encoded.offsets or [
        (None, None)
    ] * len(encoded.ids)
    return [
        {"id": token_id, "text": text, "start": start, "end": end, "special": special}
        for token_id, text, (start, end), special in zip(
            encoded.ids, encoded.tokens, offsets, encoded.special, strict=True
        )
    ]


def attention_payload(
    item: ItemResult, heads: list[int] | None, encoding: Encoding
) -> list[dict[str, Any]]:
    assert item.attention is not None, "the batch ran with these layers' maps"
    return [
        {"layer": layer, "heads": heads, "values": array_payload(values, encoding)}
        for layer, values in sorted(item.attention.items())
    ]


@router.post(
    "/encode",
    response_model=EncodeResponse,
    summary="Pooled and per-token vectors, tokens and attention maps",
)
async def encode(body: EncodeRequest, service: ServiceDep, disconnected: DisconnectDep) -> Response:
    if body.pooled or body.chunking:  # pooled vectors are an embedding model's
        require_task(service.info, "/embed")
    options = body.options()
    if body.chunking is not None:
        return await encode_chunks(body, body.chunking.options(), service, disconnected)
    result = await service.encode(body.inputs_list(), options, disconnected)
    codes = None
    if body.quantize is not None and body.pooled:  # without a pooled vector, nothing to code
        codes = iter(service.quantized(result.vectors(), body.quantize, options))
    values = sum(
        (item.token_embeddings.size if item.token_embeddings is not None else 0)
        + sum(maps.size for maps in (item.attention or {}).values())
        for item in result.items
    )
    return await render(
        lambda: encode_payload(body, result, codes), values=values, headers=timing_headers(result)
    )


def encode_payload(
    body: EncodeRequest, result: EncodeResult, codes: Iterator[CodeArray] | None
) -> dict[str, Any]:
    """`codes`: the pooled vectors' compact codes, in order, where the request asked for them."""
    spec = result.attention
    heads = list(spec.heads) if spec is not None and not spec.mean else None
    data = []
    for index, (encoded, item) in enumerate(zip(result.encoded, result.items, strict=True)):
        entry: dict[str, Any] = {"index": index, "truncated": encoded.truncated}
        if item.output is not None:
            entry["embedding"] = (
                array_payload(item.vector, body.encoding) if codes is None else next(codes)
            )
        if item.token_embeddings is not None:
            entry["token_embeddings"] = array_payload(item.token_embeddings, body.encoding)
        if body.tokens:
            entry["tokens"] = token_payload(encoded)
        if spec is not None:
            entry["attention"] = attention_payload(item, heads, body.encoding)
        data.append(entry)
    return {"model": result.model.model_id, "data": data, "usage": usage_payload(result)}


async def encode_chunks(
    body: EncodeRequest, chunking: ChunkOptions, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    if not body.pooled or body.token_embeddings or body.attention is not None:
        raise ValidationFailedError(
            "chunking gives one pooled vector per chunk: it takes pooled true, and neither "
            "token_embeddings nor attention",
            param="chunking",
        )
    options = body.options()
    result = await service.chunk(body.inputs_list(), options, chunking, disconnected)

    def embeddings(vectors: FloatArray) -> Iterable[Any]:
        """/encode's arrays (floats, or base64 with a shape), or its `quantize` codes."""
        if body.quantize is not None:
            return service.quantized(vectors, body.quantize, options)
        return [array_payload(vector, body.encoding) for vector in vectors]

    def payload() -> dict[str, Any]:
        data = []
        chunks = chunk_payloads(result, embeddings)
        for index, (plan, own) in enumerate(zip(result.plans, chunks, strict=True)):
            entry: dict[str, Any] = {"index": index, "truncated": False, "chunks": own}
            if body.tokens:
                entry["tokens"] = token_payload(plan.document)
            data.append(entry)
        return {"model": result.model.model_id, "data": data, "usage": usage_payload(result)}

    return await render(payload, values=result.values, headers=timing_headers(result))


def chunk_payloads(
    result: ChunkedResult, embeddings: Callable[[FloatArray], Iterable[Any]]
) -> list[list[dict[str, Any]]]:
    """Per text, each chunk's offsets, token count and vector (as `embeddings` gives a
    text's (chunks, D) vectors)."""
    return [
        [
            {"start": c.start, "end": c.end, "tokens": c.tokens, "embedding": embedding}
            for c, embedding in zip(plan.chunks, embeddings(vectors), strict=True)
        ]
        for plan, vectors in zip(result.plans, result.vectors, strict=True)
    ]


@router.post(
    "/embed_chunks",
    response_model=list[list[ChunkVector]],
    summary="Long texts cut into chunks: one vector per chunk, with its character offsets",
)
async def embed_chunks(
    body: ChunkRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    options = body.options()
    result = await service.chunk(body.inputs_list(), options, body.chunking.options(), disconnected)
    return await render(
        lambda: chunk_payloads(
            result, lambda vectors: encoded_vectors(vectors, body.encoding, service, options)
        ),
        values=result.values,
        headers=timing_headers(result),
    )
