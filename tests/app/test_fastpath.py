"""The lean dispatch answers exactly as FastAPI's own handling of the same routes does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from app.fastpath import FAST_ROUTES
from app.middleware import ServiceMiddleware
from tests.app.conftest import make_settings, running_app

pytestmark = pytest.mark.anyio
REQUESTS: list[tuple[str, Any]] = [
    ("/embed", {"inputs": ["hello world", "the fox"], "dimensions": 8}),
    ("/embed_all", {"inputs": "hello world"}),
    ("/v1/embeddings", {"input": ["hello"], "encoding_format": "base64"}),
    ("/embeddings", {"input": "hello"}),
    ("/similarity", {"inputs": {"source_sentence": "hello", "sentences": ["the fox"]}}),
    ("/encode", {"inputs": "hello", "token_embeddings": True, "attention": {"layers": [0]}}),
    ("/embed", {"inputs": ""}),  # invalid: the fast path leaves it to FastAPI
    ("/embed", {"inputs": "a", "colour": "red"}),
    ("/v1/embeddings", {"input": 5}),
    ("/predict", {"inputs": "hello"}),  # the wrong kind of model: 424 either way
]


def middleware_of(app: FastAPI) -> ServiceMiddleware:
    stack: Any = app.middleware_stack
    while not isinstance(stack, ServiceMiddleware):
        stack = stack.app
    return stack


async def test_fast_and_framework_paths_answer_alike(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        fast = [await client.post(path, json=body) for path, body in REQUESTS]
        middleware_of(app).fast_routes = {}
        slow = [await client.post(path, json=body) for path, body in REQUESTS]
    assert set(FAST_ROUTES) >= {("POST", path) for path, _ in REQUESTS}
    for (path, _), a, b in zip(REQUESTS, fast, slow, strict=True):
        assert a.status_code == b.status_code, path
        assert a.json() == b.json(), path
        skip = {"x-request-id", "content-length", "x-compute-time", "x-total-time"}
        skip |= {"x-tokenization-time", "x-queue-time", "x-inference-time"}
        assert {k: v for k, v in a.headers.items() if k not in skip} == {
            k: v for k, v in b.headers.items() if k not in skip
        }, path
