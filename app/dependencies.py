"""Request dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.service import DisconnectWatch, EmbeddingService, watch_disconnect

# Dependencies are `async def` although they never await: FastAPI runs plain `def` ones in
# its thread pool, a thread hop per dependency per request.


async def get_service(request: Request) -> EmbeddingService:
    service: EmbeddingService = request.app.state.service
    return service


async def disconnect_watch(request: Request) -> DisconnectWatch:
    return watch_disconnect(request.receive)


ServiceDep = Annotated[EmbeddingService, Depends(get_service)]
DisconnectDep = Annotated[DisconnectWatch, Depends(disconnect_watch)]
