"""POST /encode: pooled and per-token vectors, tokens with offsets, and attention maps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends

from app.batcher import ItemResult
from app.dependencies import DisconnectDep, ServiceDep, require_api_key
from app.errors import ValidationFailedError
from app.responses import Encoding, JSONResponse, array_payload, timing_headers
from app.routes.errors import error_responses
from app.routes.tei import pooled_vectors
from app.schemas import AttentionRequest, EncodeRequest, EncodeResponse
from model import Encoded, ModelInfo

router = APIRouter(
    tags=["encode"], dependencies=[Depends(require_api_key)], responses=error_responses()
)


def resolve_indices(asked: list[int] | None, count: int, what: str) -> list[int]:
    """None means all; negative indices count from the end, as in Python."""
    if asked is None:
        return list(range(count))
    resolved = []
    for index in asked:
        if not -count <= index < count:
            raise ValidationFailedError(
                f"{what} {index} is outside [-{count}, {count})", param=f"attention.{what}s"
            )
        resolved.append(index % count)
    return list(dict.fromkeys(resolved))


def attention_options(attention: AttentionRequest | None, info: ModelInfo) -> dict[str, Any]:
    if attention is None:
        return {}
    layers = resolve_indices(attention.layers, info.num_layers, "layer")
    heads = resolve_indices(attention.heads, info.num_heads, "head")
    return {
        "attention_layers": frozenset(layers),
        "attention_maps_per_layer": 1 if attention.reduce == "mean" else len(heads),
    }


def attention_payload(
    item: ItemResult, attention: AttentionRequest, info: ModelInfo, encoding: Encoding
) -> list[dict[str, Any]]:
    assert item.attentions is not None
    heads = resolve_indices(attention.heads, info.num_heads, "head")
    maps = []
    for layer in sorted(item.attentions):
        selected = item.attentions[layer][heads]  # (heads, T, T)
        if attention.reduce == "mean":
            maps.append(
                {
                    "layer": layer,
                    "heads": None,
                    "values": array_payload(selected.mean(axis=0), encoding),
                }
            )
        else:
            maps.append(
                {"layer": layer, "heads": heads, "values": array_payload(selected, encoding)}
            )
    return maps


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


@router.post(
    "/encode",
    response_model=EncodeResponse,
    summary="Pooled and per-token vectors, tokens and attention maps",
)
async def encode(
    body: EncodeRequest, service: ServiceDep, disconnected: DisconnectDep
) -> JSONResponse:
    info = service.info
    service.validate_dimensions(body.dimensions)
    options = replace(
        body.options(),
        token_embeddings=body.token_embeddings,
        **attention_options(body.attention, info),
    )
    result = await service.encode(body.inputs_list(), options, disconnected)
    vectors = pooled_vectors(result, body.normalize, body.dimensions) if body.pooled else None
    data = []
    for index, (encoded, item) in enumerate(zip(result.encoded, result.items, strict=True)):
        entry: dict[str, Any] = {"index": index, "truncated": encoded.truncated}
        if vectors is not None:
            entry["embedding"] = array_payload(vectors[index], body.encoding)
        if body.token_embeddings and item.token_embeddings is not None:
            entry["token_embeddings"] = array_payload(item.token_embeddings, body.encoding)
        if body.tokens:
            entry["tokens"] = token_payload(encoded)
        if body.attention is not None:
            entry["attention"] = attention_payload(item, body.attention, info, body.encoding)
        data.append(entry)
    tokens = result.token_count
    content = {
        "model": info.model_id,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONResponse(content, headers=timing_headers(result))
