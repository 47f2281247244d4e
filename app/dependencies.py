"""Request dependencies shared by the routers."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from app.errors import UnauthorizedError
from app.service import DisconnectWatch, EmbeddingService
from app.settings import Settings

# Dependencies are `async def` although they never await: FastAPI runs plain `def` ones in
# its thread pool, a thread hop per dependency per request.


async def get_service(request: Request) -> EmbeddingService:
    service: EmbeddingService = request.app.state.service
    return service


async def require_api_key(request: Request) -> None:
    """Inference and /info need `Authorization: Bearer <key>` when an API key is set."""
    settings: Settings = request.app.state.settings
    if settings.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = settings.api_key.get_secret_value()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected.encode()):
        raise UnauthorizedError("missing or wrong API key (send 'Authorization: Bearer <key>')")


async def disconnect_watch(request: Request) -> DisconnectWatch:
    """A coroutine factory that completes when the client goes away."""

    async def disconnected() -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected


ServiceDep = Annotated[EmbeddingService, Depends(get_service)]
DisconnectDep = Annotated[DisconnectWatch, Depends(disconnect_watch)]
