"""Cohere-compatible route: POST /v2/embed, which the official `cohere` SDK's
`ClientV2(base_url=...).embed` calls unchanged."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.responses import JSONResponse, encoded_vectors, timing_headers
from app.routes.errors import error_responses
from app.schemas import CohereEmbedRequest, CohereEmbedResponse, CohereInputType

router = APIRouter(tags=["cohere"], responses=error_responses())
# The folder prompt names each input type may go by, in the order they are looked for.
PROMPT_NAMES: dict[CohereInputType, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


def prompt_for(prompts: Mapping[str, str], input_type: CohereInputType | None) -> str | None:
    """The folder's prompt for the input type, its name in any case (EmbeddingGemma's are
    `Classification`, `Clustering`), else None (the model's default prompt)."""
    if input_type is None:
        return None
    by_lower = {name.lower(): name for name in prompts}
    return next((by_lower[name] for name in PROMPT_NAMES[input_type] if name in by_lower), None)


@router.post(
    "/v2/embed",
    response_model=CohereEmbedResponse,
    summary="Embeddings by type, as Cohere's v2 API returns them (always normalised)",
)
async def embed_v2(
    body: CohereEmbedRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    options = body.options(prompt_for(service.info.prompts, body.input_type))
    texts: list[str] = list(body.texts)
    result = await service.encode(list(texts), options, disconnected)
    vectors = result.vectors()
    embeddings: dict[str, object] = {}
    for kind in dict.fromkeys(body.embedding_types):
        embeddings[kind] = encoded_vectors(vectors, kind, service, options)
    content = {
        "id": str(uuid.uuid4()),  # as Cohere's are
        "response_type": "embeddings_by_type",
        "embeddings": embeddings,
        "texts": texts,
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"input_tokens": result.token_count},
        },
    }
    return JSONResponse(content, headers=timing_headers(result))
