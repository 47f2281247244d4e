"""text-embeddings-inference's and OpenAI's other routes and aliases, on a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.app.conftest import Placement, make_settings, running_app
from tests.helpers import TINY_VOCAB

pytestmark = pytest.mark.anyio
TEXTS = ["hello world", "the quick brown fox", "lazy dog"]


async def test_post_root_is_embed_or_similarity_by_body_shape(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        embed = (await client.post("/embed", json={"inputs": TEXTS})).json()
        root = await client.post("/", json={"inputs": TEXTS, "normalize": True})
        pair = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
        similar = await client.post("/", json=pair)
        direct = await client.post("/similarity", json=pair)
        bad = await client.post("/", json={"inputs": {"source_sentence": "a"}})
        empty = {"inputs": {"source_sentence": "", "sentences": ["a"]}}
        empty_root, empty_direct = [await client.post(p, json=empty) for p in ("/", "/similarity")]
        home = await client.get("/")
    assert root.status_code == 200 and np.allclose(root.json(), embed, atol=1e-6)
    vectors = np.array(embed)
    want = vectors[1:] @ vectors[0]  # unit vectors: cosine
    assert similar.status_code == 200 and np.allclose(similar.json(), want, atol=1e-5)
    assert direct.json() == similar.json()
    assert bad.status_code == 422 and bad.json()["error_type"] == "Validation"
    assert "sentences" in bad.json()["error"]
    # A similarity body's errors are /similarity's, not /embed's ("inputs: expected a string").
    assert empty_root.status_code == empty_direct.status_code != 200
    assert empty_root.json()["error"] == empty_direct.json()["error"]
    assert home.status_code == 200 and home.headers["content-type"].startswith("text/html")


async def test_similarity_follows_the_models_similarity_function(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    (tiny_checkpoint / "config_sentence_transformers.json").write_text(
        json.dumps({"similarity_fn_name": "dot"})
    )
    # modules.json of the tiny checkpoint normalises; without it, dot is not cosine.
    modules = json.loads((tiny_checkpoint / "modules.json").read_text())
    (tiny_checkpoint / "modules.json").write_text(json.dumps(modules[:2]))
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        raw = np.array(
            (await client.post("/embed", json={"inputs": TEXTS, "normalize": False})).json()
        )
        pair = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
        scores = (await client.post("/similarity", json=pair)).json()
        info = (await client.get("/info")).json()
    assert info["similarity_fn_name"] == "dot"
    assert np.allclose(scores, raw[1:] @ raw[0], rtol=1e-5)


async def test_openai_aliases_and_model_list(placement: Placement, tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        v1 = (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
        alias = (await client.post("/embeddings", json={"input": TEXTS})).json()
        models = (await client.get("/v1/models")).json()
        out_of_vocabulary = await client.post("/v1/embeddings", json={"input": [[100000]]})
    assert [d["embedding"] for d in alias["data"]] == [d["embedding"] for d in v1["data"]]
    [card] = models["data"]
    assert models["object"] == "list" and card["id"] == str(tiny_checkpoint)
    assert card["object"] == "model" and card["created"] > 0 and card["owned_by"]
    assert out_of_vocabulary.status_code == 422
    assert "check_embedding_ctx_length=False" in out_of_vocabulary.json()["error"]["message"]


async def test_decode_ping_info_and_timing_headers(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    hello, world = TINY_VOCAB.index("hello"), TINY_VOCAB.index("world")
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        one = await client.post("/decode", json={"ids": [2, hello, world, 3]})
        many = await client.post(
            "/decode", json={"ids": [[2, hello, 3], [world]], "skip_special_tokens": False}
        )
        outside = await client.post("/decode", json={"ids": [len(TINY_VOCAB)]})
        ping = await client.get("/ping")
        info = (await client.get("/info")).json()
        embed = await client.post("/embed", json={"inputs": "hello world"})
    assert one.json() == ["hello world"]
    assert many.json() == ["[CLS] hello [SEP]", "world"]
    assert outside.status_code == 422
    assert ping.status_code == 200 and ping.json() == {"status": "ok"}
    assert info["architecture"] == "bert" and info["positions"] == "learned"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32" and info["max_input_length"] == 48
    assert info["max_client_batch_size"] == 2048 and info["tokenization_workers"] == 2
    for name in ("x-compute-time", "x-total-time", "x-compute-characters", "x-compute-type"):
        assert name in embed.headers, name
    assert embed.headers["x-compute-characters"] == "11"
    assert float(embed.headers["x-total-time"]) >= float(embed.headers["x-inference-time"])
