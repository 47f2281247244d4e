"""The app factory: settings and an engine in, an app out; the lifespan waits in the
background for the engine to be ready (loading the model, where it runs in this process)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from app.balance import ConnectionBalance
from app.dispatch import post_routes
from app.engine.protocol import Engine
from app.handlers import install_handlers
from app.metrics import Metrics
from app.middleware import ServiceMiddleware
from app.models import ServedModels
from app.openapi import bounded_openapi
from app.responses import JSONResponse
from app.routes import classify, cohere, encode, openai, ops, playground, sparse, tei
from app.service import EmbeddingService
from app.settings import Settings

log = logging.getLogger(__name__)

# Routers whose routes need the API key when one is set (and /info). Probes, metrics, the
# docs and the pages stay open: orchestrators and people call them without a key.
PROTECTED_ROUTERS = (tei, openai, cohere, encode, classify, sparse)
PROTECTED_ROUTES = frozenset({("GET", "/info"), ("POST", "/")})
# Paths the concurrency limit never counts: probes must answer under any load.
UNLIMITED_PATHS = frozenset({"/health", "/live", "/ping", "/metrics"})


class EmbeddingApp(FastAPI):
    """FastAPI with the service's middleware (app/middleware.py) in front of its whole stack:
    POST routes are answered there (app/dispatch.py), without the framework's own layers on
    every request (the serving path's cost: docs/benchmarks.md); every other request goes on
    to the framework."""

    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def create_app(
    settings: Settings,
    engine: Engine | Mapping[str, Engine] | None = None,
    on_fatal: Callable[[str], None] | None = None,
    balance: ConnectionBalance | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """`engine`: where the models run, by served name (one engine alone is the first
    model's); by default in this process (which then imports torch). `on_fatal` is told
    when an engine cannot start, so the process can exit non-zero; `balance` is a front
    end's share of the connections (app/balance.py)."""
    metrics = metrics or Metrics()
    served = settings.models()
    loads_here = engine is None
    engines: Mapping[str, Engine]
    if engine is None:
        from app.engine.local import LocalEngine

        engines = {
            model.name: LocalEngine(settings.for_model(model), model, metrics) for model in served
        }
    elif isinstance(engine, Mapping):
        engines = engine
    else:
        engines = {served[0].name: engine}
    models = ServedModels(
        {
            model.name: EmbeddingService(
                settings.for_model(model), metrics.of(model.name), engines[model.name]
            )
            for model in served
        }
    )
    service = models.default

    async def start(name: str, service: EmbeddingService) -> None:
        try:
            await service.start()
        except Exception as exc:
            log.error("start-up of model %s failed: %s", name, service.load_error, exc_info=exc)
            if on_fatal is not None:
                on_fatal(f"model {name}: {service.load_error or exc}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A model loading in this process loads in the background, so that /live answers and
        # /health says 503 meanwhile. A front end's engines have loaded already: it connects
        # to them before uvicorn opens its socket, so that no request meets a front end that
        # is still starting while the others answer.
        loading = [asyncio.create_task(start(name, each)) for name, each in models.items()]
        try:
            if not loads_here:
                await asyncio.gather(*loading)
            yield
        finally:
            for task in loading:
                task.cancel()
            try:
                await asyncio.gather(*(each.stop() for each in models.values()))
            finally:
                metrics.tally.flush()  # the last requests' figures, for a scrape of the files

    app = EmbeddingApp(
        title="embedding-server",
        summary="Embeddings from a from-scratch BERT-family encoder, dynamically batched.",
        lifespan=lifespan,
        default_response_class=JSONResponse,
        # FastAPI's own docs pages load their assets from a CDN; the playground router serves
        # /docs and /redoc with assets from the app itself.
        docs_url=None,
        redoc_url=None,
        # FastAPI's own OpenTelemetry hooks ask for a provider on every request; this service
        # reports through its Prometheus metrics instead.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.service = service  # the first model's: the routes that name none
    app.state.models = models
    routes: set[str] = set()
    protected = set(PROTECTED_ROUTES)
    for module in (tei, openai, cohere, encode, classify, sparse, ops, playground):
        app.include_router(module.router)
        for route in module.router.routes:
            path = getattr(route, "path", "")
            routes.add(path)
            if module in PROTECTED_ROUTERS:
                protected.update((method, path) for method in getattr(route, "methods", ()))
    install_handlers(app)
    # The schema states the loaded model's bounds (token ids, dimensions, ...) once it has them,
    # and the API key on the routes that need it.
    app.openapi = bounded_openapi(  # type: ignore[method-assign]
        app, lambda: service.codec.info if service.codec else None, settings, protected
    )
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    app.front = ServiceMiddleware(
        app.framework,
        metrics=metrics,
        payload_limit=settings.payload_limit,
        body_timeout=settings.body_timeout,
        routes=routes,
        protected=frozenset(protected),
        api_key=api_key,
        max_concurrent=settings.max_concurrent_requests,
        unlimited=UNLIMITED_PATHS,
        models=models,
        post_routes=post_routes(module.router for module in PROTECTED_ROUTERS),
        balance=balance,
    )
    if settings.cors_origins:
        # Outermost: the POST routes' answers and the errors the service middleware writes
        # itself (401, 408, 413, 429) carry the CORS headers too.
        app.front = CORSMiddleware(
            app.front,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    return app
