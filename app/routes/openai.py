"""OpenAI-compatible embeddings: POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.dependencies import DisconnectDep, ServiceDep, require_api_key
from app.responses import (
    JSONResponse,
    base64_floats,
    pooled_vectors,
    timing_headers,
    usage_payload,
)
from app.routes.errors import error_responses
from app.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse
from app.service import EncodeOptions

router = APIRouter(
    tags=["openai"], dependencies=[Depends(require_api_key)], responses=error_responses(openai=True)
)


@router.post(
    "/v1/embeddings",
    response_model=OpenAIEmbeddingResponse,
    summary="Embeddings, as OpenAI's API returns them (always normalised)",
)
async def create_embeddings(
    body: OpenAIEmbeddingRequest, service: ServiceDep, disconnected: DisconnectDep
) -> JSONResponse:
    service.validate_dimensions(body.dimensions)
    result = await service.encode(body.inputs_list(), EncodeOptions(), disconnected)
    vectors = pooled_vectors(result, normalize=True, dimensions=body.dimensions)
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": base64_floats(vector) if body.encoding_format == "base64" else vector,
        }
        for index, vector in enumerate(vectors)
    ]
    content = {
        "object": "list",
        "data": data,
        "model": service.info.model_id,
        "usage": usage_payload(result),
    }
    return JSONResponse(content, headers=timing_headers(result))
