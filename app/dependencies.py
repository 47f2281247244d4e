"""Request dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.service import DisconnectWatch, EmbeddingService

# Dependencies are `async def` although they never await: FastAPI runs plain `def` ones in
# its thread pool, a thread hop per dependency per request.


async def get_service(request: Request) -> EmbeddingService:
    service: EmbeddingService = request.app.state.service
    return service


async def disconnect_watch(request: Request) -> DisconnectWatch:
    """A coroutine factory that completes when the client goes away."""

    async def disconnected() -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected


ServiceDep = Annotated[EmbeddingService, Depends(get_service)]
DisconnectDep = Annotated[DisconnectWatch, Depends(disconnect_watch)]
