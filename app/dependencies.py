"""Request dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.models import ServedModels
from app.service import DisconnectWatch, EmbeddingService, watch_disconnect

# Dependencies are `async def` although they never await: FastAPI runs plain `def` ones in
# its thread pool, a thread hop per dependency per request.


async def get_service(request: Request) -> EmbeddingService:
    """The model a `/models/{name}/` path chose (app/middleware.py), else the first."""
    service: EmbeddingService = getattr(request.state, "service", None) or request.app.state.service
    return service


async def get_models(request: Request) -> ServedModels:
    """The model a `/models/{name}/` path chose, else every served model."""
    named: EmbeddingService | None = getattr(request.state, "service", None)
    models: ServedModels = request.app.state.models
    return models.only(named) if named is not None else models


async def disconnect_watch(request: Request) -> DisconnectWatch:
    return watch_disconnect(request.receive)


ServiceDep = Annotated[EmbeddingService, Depends(get_service)]
ModelsDep = Annotated[ServedModels, Depends(get_models)]
DisconnectDep = Annotated[DisconnectWatch, Depends(disconnect_watch)]
