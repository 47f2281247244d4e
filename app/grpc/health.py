"""gRPC's standard health service (grpc.health.v1), as `/health` answers readiness: what
Kubernetes' `grpc` probes and Envoy's health checks call. text-embeddings-inference serves it
too. Check only: Watch stays UNIMPLEMENTED, which both of those leave alone."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Readiness(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """SERVING while `ready()`, NOT_SERVING otherwise (the model loading, a drain, a dead
    engine), for the server as a whole ("") or any of its services by name; NOT_FOUND for
    another name. It needs no API key, as the HTTP probes need none."""

    def __init__(self, ready: Callable[[], bool], services: Collection[str]) -> None:
        self.ready = ready
        self.services = {"", *services}

    async def Check(  # noqa: N802 (the rpc's name)
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        if request.service not in self.services:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}")
        response = health_pb2.HealthCheckResponse
        return response(status=response.SERVING if self.ready() else response.NOT_SERVING)


def add_health(
    server: grpc.aio.Server, ready: Callable[[], bool], services: Collection[str]
) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(Readiness(ready, services), server)
