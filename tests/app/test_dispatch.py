"""One parser for every POST body (app/parsing.py), and the table of routes it serves."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.types import Message

from app.dispatch import post_routes
from app.errors import (
    EmptyInputError,
    MalformedRequestError,
    ServiceError,
    UnsupportedMediaError,
    ValidationFailedError,
)
from app.main import PROTECTED_ROUTERS
from app.parsing import parse_body
from app.schemas import (
    DecodeRequest,
    EmbedRequest,
    PredictRequest,
    RerankRequest,
    SimilarityRequest,
)
from tests.app.conftest import Placement, make_settings, running_app

JSON = "application/json"


def test_every_post_route_of_the_schema_is_dispatched(tiny_checkpoint: Path) -> None:
    from app.main import create_app

    app = create_app(make_settings(tiny_checkpoint))
    documented = {path for path, ops in app.openapi()["paths"].items() if "post" in ops}
    assert documented <= set(post_routes(module.router for module in PROTECTED_ROUTERS))


@pytest.mark.parametrize(
    ("model", "raw", "content_type", "error", "message"),
    [
        (EmbedRequest, b'{"inputs": "a"}', "text/plain", UnsupportedMediaError, "text/plain"),
        (EmbedRequest, b"[", JSON, MalformedRequestError, "the body is not valid JSON"),
        (EmbedRequest, '{"inputs": "a"}'.encode("utf-16"), JSON, MalformedRequestError, "UTF-8"),
        (EmbedRequest, b'{"inputs": ""}', JSON, EmptyInputError, "an input is empty"),
        (EmbedRequest, b'{"inputs": ["a", ""]}', JSON, EmptyInputError, "an input is empty"),
        (EmbedRequest, b'{"inputs": []}', JSON, EmptyInputError, "an input is empty"),
        (RerankRequest, b'{"query": "q", "texts": []}', JSON, EmptyInputError, "empty"),
        (
            EmbedRequest,
            b'{"inputs": 5}',
            JSON,
            ValidationFailedError,
            "inputs: expected a string, a list of token ids, or a list mixing strings",
        ),
        (
            EmbedRequest,
            b'{"inputs": ["a", "\\ud800"]}',
            JSON,
            ValidationFailedError,
            "inputs[1] is not valid Unicode: it holds a lone surrogate",
        ),
        (
            SimilarityRequest,
            b'{"inputs": {"source_sentence": "a", "sentences": ["b", "\\ud800"]}}',
            JSON,
            ValidationFailedError,
            "inputs.sentences[1] is not valid Unicode",
        ),
        (
            SimilarityRequest,
            b'{"inputs": {"source_sentence": "\\ud800", "sentences": ["b"]}}',
            JSON,
            ValidationFailedError,
            "inputs.source_sentence is not valid Unicode",
        ),
        (
            RerankRequest,
            b'{"query": "\\ud800", "texts": ["a"]}',
            JSON,
            ValidationFailedError,
            "query is not valid Unicode",
        ),
        (
            PredictRequest,
            b'{"inputs": 3}',
            JSON,
            ValidationFailedError,
            "inputs: expected a text, a pair of texts",
        ),
        (DecodeRequest, b'{"ids": []}', JSON, ValidationFailedError, "ids: expected one list"),
        (EmbedRequest, b'{"inputs": "a", "x": 1}', JSON, ValidationFailedError, "x: Extra"),
        (EmbedRequest, b'{"inputs": "a", "dimensions": 0}', JSON, ValidationFailedError, "dim"),
    ],
)
def test_one_error_type_per_problem(
    model: Any, raw: bytes, content_type: str, error: type[ServiceError], message: str
) -> None:
    with pytest.raises(ServiceError) as caught:
        parse_body(model, raw, content_type)
    assert type(caught.value) is error
    assert message in caught.value.message


def test_valid_bodies_parse_as_they_are() -> None:
    body = parse_body(EmbedRequest, '{"inputs": ["été", [4, 5]]}'.encode(), JSON)
    assert body.inputs == ["été", [4, 5]]
    assert parse_body(EmbedRequest, b'{"inputs": "a"}', "application/vnd.x+json").inputs == "a"


@pytest.mark.anyio
async def test_the_schema_still_says_what_is_refused(tiny_checkpoint: Path) -> None:
    """The validators that make an empty input a 400 leave the published bounds as they
    were: minLength and minItems 1."""
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        schema = (await client.get("/openapi.json")).json()
    inputs = schema["components"]["schemas"]["EmbedRequest"]["properties"]["inputs"]
    branches = inputs["anyOf"]
    assert branches[0]["type"] == "string" and branches[0]["minLength"] == 1
    assert branches[1]["type"] == "array" and branches[1]["minItems"] == 1
    assert branches[2]["minItems"] == 1 and branches[2]["maxItems"] >= 1


def test_a_byte_order_mark_is_ignored() -> None:
    assert parse_body(EmbedRequest, b'\xef\xbb\xbf{"inputs": "a"}', JSON).inputs == "a"


async def post_directly(app: FastAPI, path: str, body: bytes) -> int:
    """One POST through the app's ASGI interface, with no client's objects around it; its
    status."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", JSON.encode()), (b"content-length", b"%d" % len(body))],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
        "root_path": "",
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


@pytest.mark.anyio
async def test_a_request_leaves_nothing_for_the_cycle_collector(
    tiny_checkpoint: Path, placement: Placement
) -> None:
    """What the front end makes for a request is freed by reference counts when it is
    answered: objects in a reference cycle wait for the cycle collector, whose passes cost
    the server CPU on every request (the engine's side: tests/app/test_batching.py)."""
    async with running_app(make_settings(tiny_checkpoint), placement) as (app, _):
        embed = ("/embed", b'{"inputs": ["hello world", "fox"]}')
        openai = ("/v1/embeddings", b'{"input": ["hello world", "fox"]}')
        assert await post_directly(app, *embed) == 200  # first-call caches filled
        gc.collect()
        gc.disable()
        try:
            for path, body in (embed, openai, embed, openai):
                assert await post_directly(app, path, body) == 200
            assert gc.collect() == 0
        finally:
            gc.enable()
