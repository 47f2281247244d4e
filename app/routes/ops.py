"""Operations: /info, /health (readiness), /live (liveness), /metrics."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from app.dependencies import ModelsDep, ServiceDep
from app.errors import UnavailableError
from app.handlers import error_body
from app.metrics import Metrics
from app.responses import JSONResponse
from app.routes.errors import error_responses
from app.schemas import ErrorResponse, InfoResponse, Limits, StatusResponse
from app.service import EmbeddingService
from app.tasks import TASKS
from app.tokenization import TOKENIZER_THREADS

router = APIRouter(tags=["operations"])


@functools.cache
def package_version() -> str:
    """Read from the installed metadata once, not on every /info call."""
    try:
        return version("embedding-server")
    except PackageNotFoundError:
        return "0.0.0+local"


def quantization(service: EmbeddingService) -> dict[str, object] | None:
    """The ranges int8 and uint8 codes are made on, for normalised vectors of every dimension
    (the default of every route); other dimensions and unnormalised vectors have ranges
    computed the same way from the same calibration vectors."""
    if service.calibration is None:
        return None
    ranges = service.calibration.ranges(normalize=True, dimensions=None)
    return {
        "calibration_texts": len(service.calibration.vectors),
        "min": ranges[0],
        "max": ranges[1],
    }


@router.get("/info", response_model=InfoResponse, responses=error_responses())
async def info(service: ServiceDep) -> JSONResponse:
    model = service.info
    settings = service.settings
    return JSONResponse(
        {
            "model_id": model.model_id,
            "task": str(model.task),
            "labels": list(model.labels),
            "architecture": model.model_type,
            "positions": model.positions,
            "dimensions": model.dimensions,
            "hidden_size": model.hidden_size,
            "max_input_tokens": model.max_input_tokens,
            "pooling": list(model.pooling),
            "include_prompt": model.include_prompt,
            "dense": list(model.dense),
            "normalize": model.normalize,
            "dtype": model.dtype,
            "dtype_reason": model.dtype_reason,
            "device": model.device,
            "num_layers": model.num_layers,
            "num_heads": model.num_heads,
            "prompts": dict(model.prompts),
            "default_prompt_name": model.default_prompt_name,
            "do_lower_case": model.do_lower_case,
            "similarity_fn_name": model.similarity_fn_name,
            "quantization": quantization(service),
            "auto_truncate": settings.auto_truncate,
            "limits": settings.model_dump(include=set(Limits.model_fields)),
            "version": package_version(),
            # text-embeddings-inference's names, for clients that read them.
            "model_sha": None,
            "model_dtype": model.dtype,
            "model_type": TASKS[model.task].tei_model_type(model),
            "max_concurrent_requests": settings.max_concurrent_requests,
            "max_input_length": model.max_input_tokens,
            "max_client_batch_size": settings.max_inputs_per_request,
            "max_batch_requests": settings.max_batch_inputs,
            "tokenization_workers": TOKENIZER_THREADS,
            "sha": None,
            "docker_label": None,
        }
    )


@router.get(
    "/health",
    response_model=StatusResponse,
    responses={503: {"model": ErrorResponse, "description": "Not ready to serve"}},
    summary="Readiness: model loaded and warmed up, worker alive, not draining",
)
async def health(models: ModelsDep) -> JSONResponse:
    """Every served model (or the one under /models/{name}/) ready."""
    if not models.ready:
        return not_ready(models.not_ready_reason())
    return JSONResponse({"status": "ok"})


@router.get(
    "/ping",
    response_model=StatusResponse,
    responses={503: {"model": ErrorResponse, "description": "Not ready to serve"}},
    summary="text-embeddings-inference's name for /health",
)
async def ping(models: ModelsDep) -> JSONResponse:
    return await health(models)


@router.get(
    "/live",
    response_model=StatusResponse,
    responses={503: {"model": ErrorResponse, "description": "The batch worker has died"}},
    summary="Liveness: the event loop answers and the batch worker has not died",
)
async def live(models: ModelsDep) -> JSONResponse:
    # Never touches the model; fails only when a restart is the one way back.
    if models.broken:
        return not_ready("the batch worker has stopped; the process needs a restart")
    return JSONResponse({"status": "ok"})


def not_ready(reason: str) -> JSONResponse:
    """A probe's 503 is its answer, not a failed request: not counted in
    embed_failures_total, which would otherwise rise with every start-up and drain."""
    error = UnavailableError(reason)
    return JSONResponse(error_body("/health", error), error.status)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    registry: Metrics = request.app.state.metrics
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)
