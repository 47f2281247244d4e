"""Cohere's POST /v2/embed: its request fields mapped onto this server's options (the SDK
itself is tested in test_clients.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from app.routes.cohere import prompt_for
from tests.app.conftest import make_settings, running_app

pytestmark = pytest.mark.anyio
TEXTS = ["hello world", "the quick brown fox"]


def test_input_types_find_the_folders_prompt_by_its_usual_names() -> None:
    prompts = {"query": "q: ", "passage": "p: ", "clustering": "c: "}
    assert prompt_for(prompts, "search_query") == "query"
    assert prompt_for(prompts, "search_document") == "passage"
    assert prompt_for(prompts, "clustering") == "clustering"
    assert prompt_for(prompts, "classification") is None  # the model's default prompt
    assert prompt_for({"search_query": "", "query": "q: "}, "search_query") == "search_query"
    assert prompt_for(prompts, None) is None
    assert prompt_for({"Clustering": "c: "}, "clustering") == "Clustering"


async def test_v2_embed_answers_in_cohere_shape_with_the_vectors_of_embed(
    tiny_checkpoint: Path,
) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        floats = (await client.post("/embed", json={"inputs": TEXTS})).json()
        response = await client.post(
            "/v2/embed",
            json={"texts": TEXTS, "input_type": "search_query", "embedding_types": ["float"]},
        )
        default = await client.post("/v2/embed", json={"texts": TEXTS})
    assert response.status_code == 200
    body = response.json()
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == TEXTS
    assert np.allclose(body["embeddings"]["float"], floats, atol=1e-6)
    assert body["meta"]["api_version"] == {"version": "2"}
    assert body["meta"]["billed_units"]["input_tokens"] == int(response.headers["x-compute-tokens"])
    assert list(default.json()["embeddings"]) == ["float"]  # Cohere's default type


async def test_input_type_embeds_with_the_folders_prompt(tiny_checkpoint: Path) -> None:
    """search_query takes the folder's `query` prompt and search_document its `passage`, as
    /embed's prompt_name does; an input type the folder has no prompt for takes the default
    (none here); base64 is the floats' little-endian bytes."""
    (tiny_checkpoint / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "the quick ", "passage": "lazy "}})
    )
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        prompted = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": "query"})
        passage = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": "passage"})
        plain = (await client.post("/embed", json={"inputs": TEXTS})).json()
        cohere = {
            input_type: (
                await client.post(
                    "/v2/embed",
                    json={
                        "texts": TEXTS,
                        "input_type": input_type,
                        "embedding_types": ["float", "base64"],
                    },
                )
            ).json()["embeddings"]
            for input_type in ("search_query", "search_document", "classification")
        }
    assert not np.allclose(prompted.json(), plain, atol=1e-3)  # a prompt changes the vector
    assert not np.allclose(passage.json(), plain, atol=1e-3)
    assert np.allclose(cohere["search_query"]["float"], prompted.json(), atol=1e-6)
    assert np.allclose(cohere["search_document"]["float"], passage.json(), atol=1e-6)
    assert np.allclose(cohere["classification"]["float"], plain, atol=1e-6)
    for embeddings in cohere.values():
        decoded = [np.frombuffer(base64.b64decode(v), dtype="<f4") for v in embeddings["base64"]]
        assert np.array_equal(np.stack(decoded), np.array(embeddings["float"], dtype=np.float32))


async def test_truncate_none_refuses_a_long_text_and_start_keeps_its_end(
    tiny_checkpoint: Path,
) -> None:
    long_text = "hello world " * 100
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        refused = await client.post("/v2/embed", json={"texts": [long_text], "truncate": "NONE"})
        start = await client.post("/v2/embed", json={"texts": [long_text], "truncate": "START"})
        left = await client.post(
            "/embed", json={"inputs": long_text, "truncate": True, "truncation_direction": "left"}
        )
    assert refused.status_code == 422 and "turn truncation on" in refused.text
    assert np.allclose(start.json()["embeddings"]["float"], left.json(), atol=1e-6)


@pytest.mark.parametrize(
    "body",
    [
        {"texts": []},
        {"texts": ["a"], "images": ["data:image/png;base64,AAAA"]},
        {"texts": ["a"], "input_type": "image"},
        {"texts": ["a"], "embedding_types": ["int4"]},
        {"texts": ["a"], "embedding_types": []},
        {"texts": ["a"], "truncate": "MIDDLE"},
        {"texts": ["a"], "max_tokens": 8},
    ],
)
async def test_what_is_not_implemented_is_a_clear_4xx(
    tiny_checkpoint: Path, body: dict[str, object]
) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post("/v2/embed", json=body)
    assert response.status_code in (400, 422), response.text
    assert "error" in response.json()
