"""POST /encode: pooled and per-token vectors, tokens with offsets, and attention maps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.engine.protocol import ItemResult
from app.responses import Encoding, array_payload, render, timing_headers, usage_payload
from app.routes.errors import error_responses
from app.schemas import EncodeRequest, EncodeResponse
from app.service import EncodeResult
from app.tasks import require_task
from model import Encoded
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
    if body.pooled:  # the pooled vector is an embedding model's; the rest any model has
        require_task(service.info, "/embed")
    options = body.options()
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
