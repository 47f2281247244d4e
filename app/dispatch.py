"""Every POST route's body goes through one parser (app/parsing.py), called here, by the
middleware, for the route's own endpoint function.

FastAPI's per-request machinery (matching against every route, solving dependencies, parsing
the body to Python objects and then validating them) costs as much CPU as the model's own
share of the work for a short sentence on a small machine, and would be a second parser.
The routes stay declared on their routers: those remain the one description of the API
(OpenAPI, the docs), and the table below is read off them, so that no POST route is missed.
A route of another task than the model's answers 424 (app/tasks/); `POST /`,
text-embeddings-inference's alias for the model's main task, goes where the task says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive

from app.models import ServedModels
from app.parsing import parse_body
from app.service import DisconnectWatch, EmbeddingService, watch_disconnect
from app.tasks import TASKS, require_task

Endpoint = Callable[[Any, EmbeddingService, DisconnectWatch], Awaitable[Response]]


@dataclass(frozen=True)
class PostRoute:
    body: type[BaseModel]
    endpoint: Endpoint


def post_routes(routers: Iterable[APIRouter]) -> dict[str, PostRoute]:
    """Path to route, for every POST route the routers declare; the body model is read off
    the endpoint's own `body` annotation, so the two cannot differ."""
    table = {}
    for router in routers:
        for route in router.routes:
            if isinstance(route, APIRoute) and "POST" in (route.methods or ()):
                body: type[BaseModel] = get_type_hints(route.endpoint)["body"]
                table[route.path] = PostRoute(body, route.endpoint)
    return table


def main_route(routes: Mapping[str, PostRoute], service: EmbeddingService, raw: bytes) -> PostRoute:
    """`POST /`, which huggingface_hub's InferenceClient calls when it is given a base URL:
    the route of the model's main task (app/tasks/)."""
    info = service.info
    return routes[TASKS[info.task].main_path(info, raw)]


async def dispatch(
    path: str,
    route: PostRoute,
    raw: bytes,
    content_type: str,
    models: ServedModels,
    named: EmbeddingService | None,
    receive: Receive,
) -> Response:
    """`named`: the model a `/models/{name}/` path chose, if any (app/models.py)."""
    body = parse_body(route.body, raw, content_type)
    service = models.for_body(body, named)
    require_task(service.info, path)
    return await route.endpoint(body, service, watch_disconnect(receive))
