"""A lean dispatch for the inference routes, which carry nearly all of a server's requests.

For a short sentence, FastAPI's per-request machinery (matching against every route, solving
dependencies, parsing the body to Python objects and then validating them) costs as much
CPU as the model's own share of the work on a small machine. For the routes listed here the
middleware validates the raw body in one step (pydantic's JSON parser) and calls the route's
own endpoint function. The routes stay declared on their routers: those remain the one
description of the API (OpenAPI, the docs), and they serve any request the fast path leaves
to them: a body that fails validation goes the usual way, so every error is FastAPI's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import Receive

from app.routes import classify, encode, openai, sparse, tei
from app.service import DisconnectWatch, EmbeddingService, watch_disconnect

Endpoint = Callable[[Any, EmbeddingService, DisconnectWatch], Awaitable[Response]]


@dataclass(frozen=True)
class FastRoute:
    body: type[BaseModel]
    endpoint: Endpoint


def _route(endpoint: Callable[..., Awaitable[Response]]) -> FastRoute:
    """The body model is read off the endpoint's own annotation, so the two cannot differ."""
    body: type[BaseModel] = get_type_hints(endpoint)["body"]
    return FastRoute(body, endpoint)


FAST_ROUTES: Mapping[tuple[str, str], FastRoute] = {
    ("POST", "/embed"): _route(tei.embed),
    ("POST", "/embed_all"): _route(tei.embed_all),
    ("POST", "/similarity"): _route(tei.similarity),
    ("POST", "/v1/embeddings"): _route(openai.create_embeddings),
    ("POST", "/embeddings"): _route(openai.create_embeddings),
    ("POST", "/encode"): _route(encode.encode),
    ("POST", "/predict"): _route(classify.predict),
    ("POST", "/rerank"): _route(classify.rerank),
    ("POST", "/embed_sparse"): _route(sparse.embed_sparse),
}


async def dispatch(
    route: FastRoute, raw: bytes, service: EmbeddingService, receive: Receive
) -> Response | None:
    """The endpoint's response, or None when the body is not valid (FastAPI then answers)."""
    try:
        body = route.body.model_validate_json(raw)
    except ValidationError:
        return None
    return await route.endpoint(body, service, watch_disconnect(receive))
