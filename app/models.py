"""The served models of a front end: each model's service (its engine, queue and tokenizer)
by the name requests choose it by.

A route under `/models/{name}/` is that model's; OpenAI's and Cohere's bodies name theirs in
`model`; everything else is the first model's, so that a client of a one-model server works
unchanged. With one model, `model` is not checked (clients send whatever name their library
defaults to); with several, it must name one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

from pydantic import BaseModel

from app.errors import UnknownModelError
from app.service import EmbeddingService

PREFIX = "/models/"


class ServedModels(Mapping[str, EmbeddingService]):
    def __init__(self, services: Mapping[str, EmbeddingService]) -> None:
        self._services = dict(services)
        self.default = next(iter(self._services.values()))
        # Longest first: a name may contain '/' (an id such as org/model), and one name may
        # begin another.
        self._by_length = sorted(self._services, key=len, reverse=True)

    def __getitem__(self, name: str) -> EmbeddingService:
        service = self._services.get(name)
        if service is None:
            raise UnknownModelError(
                f"this server does not serve a model named {name!r}; it serves "
                f"{', '.join(map(repr, self._services))}",
                param="model",
            )
        return service

    def __iter__(self) -> Iterator[str]:
        return iter(self._services)

    def __len__(self) -> int:
        return len(self._services)

    def route(self, path: str) -> tuple[EmbeddingService | None, str]:
        """The model a `/models/{name}/...` path names and the route below it; else None and
        the path as it is. 404 for a name not served."""
        if not path.startswith(PREFIX):
            return None, path
        rest = path[len(PREFIX) :]
        for name in self._by_length:
            if rest.startswith(name + "/"):
                return self._services[name], rest[len(name) :]
        raise UnknownModelError(
            f"{path}: no served model's routes; the models are "
            f"{', '.join(PREFIX + name + '/' for name in self._services)}"
        )

    def for_body(self, body: BaseModel, named: EmbeddingService | None) -> EmbeddingService:
        """The route's model (`named`), else the one the body's `model` names where several
        are served, else the first."""
        if named is not None:
            return named
        if len(self) == 1:  # before the lookup: a missing attribute costs pydantic a raise
            return self.default
        asked = getattr(body, "model", None)
        return self[asked] if isinstance(asked, str) else self.default

    def only(self, service: EmbeddingService) -> ServedModels:
        """The one model a `/models/{name}/` path chose, as a set of one."""
        name = next(name for name, each in self._services.items() if each is service)
        return ServedModels({name: service})

    # Readiness, liveness and the drain, over every model -----------------------------------
    @property
    def ready(self) -> bool:
        return all(service.ready for service in self.values())

    def not_ready_reason(self) -> str:
        for name, service in self.items():
            if not service.ready:
                reason = service.not_ready_reason()
                return reason if len(self) == 1 else f"model {name}: {reason}"
        return ""

    @property
    def broken(self) -> bool:
        return any(service.broken for service in self.values())

    @property
    def stopping(self) -> bool:
        return any(service.stopping for service in self.values())

    @property
    def inflight(self) -> int:
        return sum(service.inflight for service in self.values())

    def begin_stop(self) -> None:
        for service in self.values():
            service.begin_stop()

    def begin_drain(self) -> None:
        for service in self.values():
            service.begin_drain()

    async def wait_idle(self, grace: float) -> bool:
        """Every model's accepted requests done within `grace` seconds."""
        waits = [service.wait_idle(grace) for service in self.values()]
        return all(await asyncio.gather(*waits))
