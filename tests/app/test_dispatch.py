"""One parser for every POST body (app/parsing.py), and the table of routes it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
from app.schemas import DecodeRequest, EmbedRequest, PredictRequest, RerankRequest
from tests.app.conftest import make_settings, running_app

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
