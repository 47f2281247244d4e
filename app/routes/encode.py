"""POST /encode: pooled and per-token vectors, tokens with offsets, and attention maps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Depends

from app.batcher import ItemResult
from app.dependencies import DisconnectDep, ServiceDep, require_api_key
from app.errors import ValidationFailedError
from app.responses import (
    Encoding,
    JSONResponse,
    array_payload,
    pooled_vectors,
    timing_headers,
    usage_payload,
)
from app.routes.errors import error_responses
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


@dataclass(frozen=True)
class AttentionSelection:
    """The layers and heads a request asked for, checked against the model once."""

    layers: frozenset[int]
    heads: list[int]
    mean: bool

    @classmethod
    def resolve(cls, attention: AttentionRequest, info: ModelInfo) -> AttentionSelection:
        return cls(
            frozenset(resolve_indices(attention.layers, info.num_layers, "layer")),
            resolve_indices(attention.heads, info.num_heads, "head"),
            attention.reduce == "mean",
        )

    def payload(self, item: ItemResult, encoding: Encoding) -> list[dict[str, Any]]:
        assert item.attentions is not None, "the batch ran with these layers' maps"
        maps = []
        for layer in sorted(item.attentions):
            selected = item.attentions[layer][self.heads]  # (heads, T, T)
            if self.mean:
                values, heads = selected.mean(axis=0), None
            else:
                values, heads = selected, self.heads
            maps.append({"layer": layer, "heads": heads, "values": array_payload(values, encoding)})
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
    attention = AttentionSelection.resolve(body.attention, info) if body.attention else None
    options = replace(body.options(), token_embeddings=body.token_embeddings)
    if attention is not None:
        options = replace(
            options,
            attention_layers=attention.layers,
            attention_maps_per_layer=1 if attention.mean else len(attention.heads),
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
        if attention is not None:
            entry["attention"] = attention.payload(item, body.encoding)
        data.append(entry)
    content = {"model": info.model_id, "data": data, "usage": usage_payload(result)}
    return JSONResponse(content, headers=timing_headers(result))
