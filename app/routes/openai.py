"""OpenAI-compatible routes: POST /v1/embeddings (and /embeddings, text-embeddings-inference's
path for it), GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ModelsDep, ServiceDep
from app.responses import JSONResponse, encoded_vectors, timing_headers, usage_payload
from app.routes.errors import error_responses
from app.schemas import ModelList, OpenAIEmbeddingRequest, OpenAIEmbeddingResponse

router = APIRouter(tags=["openai"], responses=error_responses(openai=True))
OWNER = "embedding-server"


@router.post(
    "/v1/embeddings",
    response_model=OpenAIEmbeddingResponse,
    summary="Embeddings, as OpenAI's API returns them (always normalised)",
)
async def create_embeddings(
    body: OpenAIEmbeddingRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    options = body.options()
    result = await service.encode(body.inputs_list(), options, disconnected)
    # base64 is the official client's default: each vector as it lies in memory.
    embeddings = encoded_vectors(result.vectors(), body.encoding_format, service, options)
    data = [
        {"object": "embedding", "index": index, "embedding": embedding}
        for index, embedding in enumerate(embeddings)
    ]
    content = {
        "object": "list",
        "data": data,
        "model": result.model.model_id,
        "usage": usage_payload(result),
    }
    return JSONResponse(content, headers=timing_headers(result))


router.add_api_route(
    "/embeddings",
    create_embeddings,
    methods=["POST"],
    response_model=OpenAIEmbeddingResponse,
    include_in_schema=False,  # an alias: documented once, as /v1/embeddings
)


@router.get(
    "/v1/models", response_model=ModelList, summary="The served models, as OpenAI lists them"
)
async def list_models(models: ModelsDep) -> Response:
    cards = [
        {
            "id": service.info.model_id,
            "object": "model",
            "created": service.loaded_at,
            "owned_by": OWNER,
        }
        for service in models.values()
    ]
    return JSONResponse({"object": "list", "data": cards})
