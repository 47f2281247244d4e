"""OpenAI-compatible embeddings: POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.responses import JSONResponse, base64_floats, embeddings, timing_headers, usage_payload
from app.routes.errors import error_responses
from app.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse

router = APIRouter(tags=["openai"], responses=error_responses(openai=True))


@router.post(
    "/v1/embeddings",
    response_model=OpenAIEmbeddingResponse,
    summary="Embeddings, as OpenAI's API returns them (always normalised)",
)
async def create_embeddings(
    body: OpenAIEmbeddingRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
    vectors = embeddings(result)
    as_base64 = body.encoding_format == "base64"
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": base64_floats(vector) if as_base64 else vector,
        }
        for index, vector in enumerate(vectors)
    ]
    content = {
        "object": "list",
        "data": data,
        "model": result.model.model_id,
        "usage": usage_payload(result),
    }
    return JSONResponse(content, headers=timing_headers(result))
