"""Bad input: each case gets its documented status and error shape, and nothing else breaks."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Message, Scope

from tests.app.conftest import GatedForward, Placement, make_settings, running_app, service_of
from tests.helpers import TINY_VOCAB

pytestmark = pytest.mark.anyio
LIMITS = {"payload_limit": 4096, "max_inputs_per_request": 8, "max_attention_values": 500}
LONG = " ".join(["hello world"] * 40)


async def oversize_chunks() -> AsyncIterator[bytes]:
    for chunk in (b'{"inputs": "', b"y" * 5000, b'"}'):
        yield chunk


def js(body: Any) -> dict[str, Any]:
    return {"content": json.dumps(body), "headers": {"content-type": "application/json"}}


# (name, method, path, request kwargs, status, error_type)
CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    (
        "malformed json",
        "POST",
        "/embed",
        {"content": b"{bad", "headers": {"content-type": "application/json"}},
        400,
        "Malformed",
    ),
    (
        "non-utf8 body",
        "POST",
        "/embed",
        {"content": b'{"inputs": "\xff\xfe"}', "headers": {"content-type": "application/json"}},
        400,
        "Malformed",
    ),
    (
        "wrong content type",
        "POST",
        "/embed",
        {"content": b'{"inputs": "a"}', "headers": {"content-type": "text/plain"}},
        415,
        "UnsupportedMediaType",
    ),
    (
        "compressed body",
        "POST",
        "/embed",
        {
            "content": gzip.compress(b'{"inputs": "a"}'),
            "headers": {"content-type": "application/json", "content-encoding": "gzip"},
        },
        415,
        "UnsupportedMediaType",
    ),
    ("empty list", "POST", "/embed", js({"inputs": []}), 400, "Empty"),
    ("empty string", "POST", "/embed", js({"inputs": ""}), 400, "Empty"),
    ("empty string in a list", "POST", "/embed", js({"inputs": ["a", ""]}), 400, "Empty"),
    ("empty id list", "POST", "/embed", js({"inputs": [[]]}), 400, "Empty"),
    ("inputs a number", "POST", "/embed", js({"inputs": 5}), 422, "Validation"),
    ("inputs null", "POST", "/embed", js({"inputs": None}), 422, "Validation"),
    ("inputs missing", "POST", "/embed", js({"normalize": True}), 422, "Validation"),
    ("float ids", "POST", "/embed", js({"inputs": [1.5, 2]}), 422, "Validation"),
    ("nested too deep", "POST", "/embed", js({"inputs": [[["a"]]]}), 422, "Validation"),
    ("body is a list", "POST", "/embed", js(["a"]), 422, "Validation"),
    ("unknown field", "POST", "/embed", js({"inputs": "a", "colour": "red"}), 422, "Validation"),
    (
        "normalize a string",
        "POST",
        "/embed",
        js({"inputs": "a", "normalize": "yes"}),
        422,
        "Validation",
    ),
    (
        "negative dimensions",
        "POST",
        "/embed",
        js({"inputs": "a", "dimensions": -1}),
        422,
        "Validation",
    ),
    ("zero dimensions", "POST", "/embed", js({"inputs": "a", "dimensions": 0}), 422, "Validation"),
    (
        "huge dimensions",
        "POST",
        "/embed",
        js({"inputs": "a", "dimensions": 10**9}),
        422,
        "Validation",
    ),
    (
        "dimensions a string",
        "POST",
        "/embed",
        js({"inputs": "a", "dimensions": "8"}),
        422,
        "Validation",
    ),
    (
        "bad truncation direction",
        "POST",
        "/embed",
        js({"inputs": "a", "truncation_direction": "up"}),
        422,
        "Validation",
    ),
    (
        "too long, truncate off",
        "POST",
        "/embed",
        js({"inputs": LONG, "truncate": False}),
        422,
        "Validation",
    ),
    (
        "id out of range",
        "POST",
        "/embed",
        js({"inputs": [2, len(TINY_VOCAB), 3]}),
        422,
        "Validation",
    ),
    ("negative id", "POST", "/embed", js({"inputs": [[2, -4, 3]]}), 422, "Validation"),
    (
        "unknown prompt_name",
        "POST",
        "/embed",
        js({"inputs": "a", "prompt_name": "query"}),
        422,
        "Validation",
    ),
    ("too many inputs", "POST", "/embed", js({"inputs": ["a"] * 9}), 413, "PayloadTooLarge"),
    ("huge string", "POST", "/embed", js({"inputs": "x" * 100_000}), 413, "PayloadTooLarge"),
    (
        "oversize chunked body",
        "POST",
        "/embed",
        # A function: each use needs a fresh stream.
        {"content": oversize_chunks, "headers": {"content-type": "application/json"}},
        413,
        "PayloadTooLarge",
    ),
    (
        "attention over the limit",
        "POST",
        "/encode",
        js({"inputs": LONG, "attention": {}}),
        422,
        "Validation",
    ),
    (
        "attention layer out of range",
        "POST",
        "/encode",
        js({"inputs": "a", "attention": {"layers": [7]}}),
        422,
        "Validation",
    ),
    (
        "attention head out of range",
        "POST",
        "/encode",
        js({"inputs": "a", "attention": {"heads": [-9]}}),
        422,
        "Validation",
    ),
    (
        "attention reduce unknown",
        "POST",
        "/encode",
        js({"inputs": "a", "attention": {"reduce": "max"}}),
        422,
        "Validation",
    ),
    (
        "encode encoding unknown",
        "POST",
        "/encode",
        js({"inputs": "a", "encoding": "hex"}),
        422,
        "Validation",
    ),
    ("tokenize ids", "POST", "/tokenize", js({"inputs": [[1.5]]}), 422, "Validation"),
    ("get on a post route", "GET", "/embed", {}, 405, "MethodNotAllowed"),
    ("unknown route", "POST", "/nope", js({}), 404, "NotFound"),
    ("openai empty input", "POST", "/v1/embeddings", js({"input": [], "model": "m"}), 400, "empty"),
    (
        "openai bad encoding",
        "POST",
        "/v1/embeddings",
        js({"input": "a", "encoding_format": "hex"}),
        422,
        "validation",
    ),
    (
        "openai bad dimensions",
        "POST",
        "/v1/embeddings",
        js({"input": "a", "dimensions": 0}),
        422,
        "validation",
    ),
    (
        "openai malformed",
        "POST",
        "/v1/embeddings",
        {"content": b"[", "headers": {"content-type": "application/json"}},
        400,
        "malformed",
    ),
    ("openai too many", "POST", "/v1/embeddings", js({"input": ["a"] * 9}), 413, "payloadtoolarge"),
    ("openai alias, empty input", "POST", "/embeddings", js({"input": ""}), 400, "empty"),
]


async def test_bad_input_gets_its_status_and_shape(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    """Every case in one server, one after another: each gets its own answer, and the
    service keeps serving after each."""
    async with running_app(make_settings(tiny_checkpoint, **LIMITS), placement) as (_, client):
        for name, method, path, kwargs, status, error_type in CASES:
            if callable(kwargs.get("content")):
                kwargs = {**kwargs, "content": kwargs["content"]()}
            response = await client.request(method, path, **kwargs)
            assert response.status_code == status, (name, response.text)
            body = response.json()
            if path.startswith("/v1/") or path == "/embeddings":
                assert set(body) == {"error"}, name
                assert set(body["error"]) == {"message", "type", "param", "code"}, name
                assert body["error"]["code"] == error_type, name
                assert body["error"]["type"] == "invalid_request_error", name
            else:
                assert set(body) == {"error", "error_type"}, name
                assert body["error_type"] == error_type, name
            assert "Traceback" not in response.text, name
            assert (await client.post("/embed", json={"inputs": "hello"})).status_code == 200
            assert (await client.get("/health")).status_code == 200


async def test_json_media_types_are_read_as_fastapi_reads_them(tiny_checkpoint: Path) -> None:
    """application/json (with parameters) and application/*+json are JSON on the fast path,
    the routers and the TEI root alike; text/json is not."""
    body = b'{"inputs": "hello"}'
    statuses: dict[tuple[str, str], int] = {}
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        for path in ("/embed", "/"):
            for media in ("application/json; charset=utf-8", "application/vnd.api+json"):
                answer = await client.post(path, content=body, headers={"content-type": media})
                statuses[path, media] = answer.status_code
            answer = await client.post(path, content=body, headers={"content-type": "text/json"})
            statuses[path, "text/json"] = answer.status_code
    assert statuses == {
        (path, media): 415 if media == "text/json" else 200
        for path in ("/embed", "/")
        for media in ("application/json; charset=utf-8", "application/vnd.api+json", "text/json")
    }


async def test_errors_name_the_limit_and_the_size(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    async with running_app(make_settings(tiny_checkpoint, **LIMITS), placement) as (_, client):
        attention = await client.post("/encode", json={"inputs": LONG, "attention": {}})
        many = await client.post("/embed", json={"inputs": ["a"] * 9})
        wrong = await client.post("/embed", json={"inputs": [1.5]})
        metrics = (await client.get("/metrics")).text
    assert "limit of 500" in attention.json()["error"]
    assert str(2 * 4 * 48 * 48) in attention.json()["error"]  # layers x heads x T^2
    assert "9 inputs" in many.json()["error"] and "limit of 8" in many.json()["error"]
    assert wrong.json()["error"].startswith("inputs: expected a string, a list of token ids")
    assert 'embed_failures_total{reason="Validation"} 2.0' in metrics
    assert 'embed_failures_total{reason="PayloadTooLarge"} 1.0' in metrics


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic s3cret", "s3cret"])
async def test_api_key_is_required_on_inference_and_info(
    tiny_checkpoint: Path, header: str | None
) -> None:
    headers = {"authorization": header} if header else {}
    async with running_app(make_settings(tiny_checkpoint, api_key="s3cret")) as (
        _,
        client,
    ):
        for path, body in (
            ("/embed", {"inputs": "a"}),
            ("/encode", {"inputs": "a"}),
            ("/embed_all", {"inputs": "a"}),
            ("/tokenize", {"inputs": "a"}),
        ):
            response = await client.post(path, json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error_type"] == "Unauthorized"
        openai_response = await client.post("/v1/embeddings", json={"input": "a"}, headers=headers)
        assert openai_response.status_code == 401
        assert openai_response.json()["error"]["type"] == "authentication_error"
        assert (await client.get("/info", headers=headers)).status_code == 401
        for path in ("/health", "/live", "/metrics"):  # probes and scrapes need no key
            assert (await client.get(path)).status_code == 200
        good = {"authorization": "Bearer s3cret"}
        assert (await client.post("/embed", json={"inputs": "a"}, headers=good)).status_code == 200


async def test_unexpected_error_is_a_generic_500_with_request_id(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.routes import tei

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("secret internal detail")

    monkeypatch.setattr(tei, "timing_headers", broken)
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post(
            "/embed", json={"inputs": "a"}, headers={"x-request-id": "abc123"}
        )
        assert response.status_code == 500
        assert response.json() == {
            "error": "internal error (request id abc123)",
            "error_type": "Internal",
        }
        assert response.headers["x-request-id"] == "abc123"
        assert (await client.post("/encode", json={"inputs": "a"})).status_code == 200


def post_scope(path: str, headers: list[tuple[bytes, bytes]]) -> Scope:
    """A POST as uvicorn hands it to the app, with these headers as the client sent them."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
    }


async def test_a_client_gone_mid_body_is_never_served(tiny_checkpoint: Path) -> None:
    """A body cut short by a disconnect is not a whole body: a 499, and nothing runs (the
    part that came, `{"inputs": "hello world"}`, would parse)."""
    part = b'{"inputs": "hello world"}'
    messages: list[Message] = [
        {"type": "http.request", "body": part, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # nothing more ever comes
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    scope = post_scope("/embed", [(b"content-length", b"4000")])
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        gate = GatedForward(service_of(app))
        await app(scope, receive, send)
        metrics = (await client.get("/metrics")).text
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert gate.batches == []
    assert 'embed_requests_total{route="/embed",status="499"} 1.0' in metrics


@pytest.mark.parametrize(
    ("declared", "status"),
    [(b"0" * 5000 + b"15", 200), (b"9" * 5000, 413), (b"4097", 413), (b"15x", 200)],
)
async def test_a_content_length_of_any_digits_is_read_as_a_number(
    tiny_checkpoint: Path, declared: bytes, status: int
) -> None:
    """httptools passes on a Content-Length of thousands of digits, which Python's `int`
    refuses past 4,300 of them: its value decides, leading zeros and all. One that is not a
    number leaves the body to be read as it comes (uvicorn's parser has refused it first)."""
    body = b'{"inputs": "a"}'
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = post_scope("/embed", [(b"content-length", declared)])
    async with running_app(make_settings(tiny_checkpoint, **LIMITS)) as (app, _):
        await app(scope, receive, send)
    assert sent[0]["status"] == status


@pytest.mark.parametrize("ids", [[], [[]], [[4, 5], []], "x", [4, -1], [[4], 5]])
async def test_decode_says_what_ids_it_takes(tiny_checkpoint: Path, ids: object) -> None:
    """Its field is a union (one list, or lists): the error says what fits, not which of
    pydantic's branches failed first."""
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post("/decode", json={"ids": ids})
    assert response.status_code == 422
    assert response.json() == {
        "error": "ids: expected one list of token ids (integers from 0), or a list of such "
        "lists; none of them empty.",
        "error_type": "Validation",
    }


@pytest.mark.parametrize("path", ["/embed", "/tokenize", "/v1/embeddings"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
async def test_a_body_that_is_not_utf8_is_malformed(
    tiny_checkpoint: Path, path: str, encoding: str
) -> None:
    """JSON travels as UTF-8 (RFC 8259); the framework's own parser would take these too."""
    body = json.dumps({"inputs": "hello", "input": "hello"}).encode(encoding)
    headers = {"content-type": "application/json"}
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post(path, content=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert message == "the body is not UTF-8, as JSON must be"


async def test_post_root_answers_a_lone_surrogate_as_embed_does(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    """`"\\ud800"` is valid JSON but not text: /embed says so with a 422, and so does POST /,
    whose own parser (pydantic's) refuses it as JSON."""
    body = b'{"inputs": "\\ud800"}'
    headers = {"content-type": "application/json"}
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        embed = await client.post("/embed", content=body, headers=headers)
        root = await client.post("/", content=body, headers=headers)
        broken = await client.post("/", content=b'{"inputs": ', headers=headers)
    assert embed.status_code == 422 and "lone surrogate" in embed.json()["error"]
    assert (root.status_code, root.json()) == (422, embed.json())
    assert broken.status_code == 400 and broken.json()["error_type"] == "Malformed"


@pytest.mark.parametrize(
    "body",
    [
        b'\xef\xbb\xbf{"inputs": {"source_sentence": "hello", "sentences": ["world"]}}',
        b'{"inputs": {"source_sentence": "hello", "sentences": ["\\ud800"]}}',
    ],
)
async def test_post_root_reads_a_similarity_body_as_similarity_does(
    tiny_checkpoint: Path, body: bytes
) -> None:
    """JSON that orjson refuses but the parser reads (a byte order mark, a lone surrogate)
    still finds POST /'s route by its shape: /similarity's answer, or its error."""
    headers = {"content-type": "application/json"}
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        similarity = await client.post("/similarity", content=body, headers=headers)
        root = await client.post("/", content=body, headers=headers)
    assert similarity.status_code in (200, 422)
    assert (root.status_code, root.json()) == (similarity.status_code, similarity.json())


async def test_decode_keeps_the_request_limits(tiny_checkpoint: Path) -> None:
    """Id lists count as inputs and ids as tokens, as the other routes count them; a long
    list is decoded off the event loop, to the same text."""
    limits = {"max_inputs_per_request": 2, "max_request_tokens": 600}
    async with running_app(make_settings(tiny_checkpoint, **limits)) as (_, client):
        lists = await client.post("/decode", json={"ids": [[5], [5], [5]]})
        tokens = await client.post("/decode", json={"ids": [[5] * 300, [5] * 301]})
        long = await client.post("/decode", json={"ids": [5] * 600})
        short = await client.post("/decode", json={"ids": [5]})
    assert lists.status_code == 413 and "holds 3 inputs" in lists.json()["error"]
    assert tokens.status_code == 413 and "holds 601 tokens" in tokens.json()["error"]
    assert long.status_code == 200 and short.status_code == 200
    assert long.json()[0].split() == short.json()[0].split() * 600


async def test_a_body_sent_as_it_is_may_say_so(tiny_checkpoint: Path) -> None:
    """`Content-Encoding: identity` is no encoding: served, where gzip is a 415."""
    headers = {"content-type": "application/json", "content-encoding": "identity"}
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post("/embed", content=b'{"inputs": "a"}', headers=headers)
    assert response.status_code == 200


async def test_decode_names_the_first_id_outside_the_vocabulary(tiny_checkpoint: Path) -> None:
    size = len(TINY_VOCAB)
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post("/decode", json={"ids": [[5, 6], [7, size + 3, size]]})
        inside = await client.post("/decode", json={"ids": [[5, size - 1]]})
    assert response.status_code == 422
    assert response.json()["error"] == (
        f"ids 1: token id {size + 3} at position 1 is outside the vocabulary [0, {size})"
    )
    assert inside.status_code == 200
