"""Sparse (SPLADE) embeddings, as text-embeddings-inference serves them: POST /embed_sparse."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.dependencies import DisconnectDep, ServiceDep
from app.responses import JSONResponse, timing_headers
from app.routes.errors import error_responses
from app.schemas import EmbedSparseRequest, SparseValue

router = APIRouter(tags=["text-embeddings-inference"], responses=error_responses())


@router.post(
    "/embed_sparse",
    response_model=list[list[SparseValue]],
    summary="Sparse embeddings: a weight for each vocabulary id the input activates",
)
async def embed_sparse(
    body: EmbedSparseRequest, service: ServiceDep, disconnected: DisconnectDep
) -> Response:
    result = await service.encode(body.inputs_list(), body.options(), disconnected)
    content = []
    for item in result.items:
        ids, weights = item.sparse
        content.append(
            [
                {"index": index, "value": value}
                for index, value in zip(ids.tolist(), weights.tolist(), strict=True)
            ]
        )
    return JSONResponse(content, headers=timing_headers(result))
