"""Every route's happy path and response shape, on a tiny random checkpoint."""

from __future__ import annotations

import base64
import re
from importlib.metadata import version
from pathlib import Path

import numpy as np
import openai
import pytest

from app.params import EncodeOptions
from model import AttentionSpec, Embedder, finish
from model.compiled import CompiledNetwork
from model.tokenizer import NO_DETAILS
from tests.app.conftest import Placement, local_engine, make_settings, running_app, service_of
from tests.helpers import TINY_VOCAB, graph_runs

pytestmark = pytest.mark.anyio
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog"]


def reference(
    tiny_embedder: Embedder, texts: list[str], normalize: bool = True, dimensions: int | None = None
) -> np.ndarray:
    pooled = tiny_embedder.forward(tiny_embedder.tokenize(texts)).pooled
    return finish(pooled.numpy(), normalize, dimensions)


async def test_texts_keep_their_tokens_only_for_a_route_that_shows_them(
    tiny_checkpoint: Path,
) -> None:
    """The vector routes keep each text's ids alone (two texts, tokenized together without
    tracking offsets); /encode with `tokens` keeps their tokens and offsets too (its response
    is checked below)."""
    async with running_app(make_settings(tiny_checkpoint)) as (app, _):
        service = service_of(app)
        bare = await service.encode(TEXTS, EncodeOptions())
        kept = await service.encode(TEXTS, EncodeOptions(token_details=True))
    for alone, full in zip(bare.encoded, kept.encoded, strict=True):
        assert alone.details is NO_DETAILS and alone.ids == full.ids
        assert full.offsets is not None and len(full.tokens) == len(full.ids)
    assert kept.encoded[0].tokens == ["[CLS]", "hello", "world", "[SEP]"]
    assert np.array_equal(bare.vectors(), kept.vectors())


async def test_embed_matches_the_model(
    placement: Placement, tiny_checkpoint: Path, tiny_embedder: Embedder
) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        response = await client.post("/embed", json={"inputs": TEXTS})
        single = await client.post("/embed", json={"inputs": "hello world"})
        raw = await client.post(
            "/embed", json={"inputs": TEXTS, "normalize": False, "dimensions": 8}
        )
    assert response.status_code == 200
    vectors = np.array(response.json(), dtype=np.float32)
    assert vectors.shape == (2, 32)
    assert np.abs(vectors - reference(tiny_embedder, TEXTS)).max() <= 1e-5
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.array(single.json()).shape == (1, 32)
    unnormalised = np.array(raw.json(), dtype=np.float32)
    assert unnormalised.shape == (2, 8)
    assert np.abs(unnormalised - reference(tiny_embedder, TEXTS, False, 8)).max() <= 1e-5
    for header in (
        "x-compute-tokens",
        "x-tokenization-time",
        "x-queue-time",
        "x-inference-time",
        "x-request-id",
    ):
        assert header in response.headers
    assert response.headers["x-compute-tokens"] == str(
        sum(len(e.ids) for e in tiny_embedder.tokenize(TEXTS))
    )


async def test_a_compiled_server_answers_as_the_model_does(
    tiny_checkpoint: Path, tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compile`: the passes compiled at start-up, one input or several (a pass sent to a
    graph whose guards fail raises here rather than run eagerly)."""
    monkeypatch.setattr(CompiledNetwork, "stance", "fail_on_recompile")
    settings = make_settings(tiny_checkpoint, compile=True)
    async with running_app(settings, ready_within=120) as (app, client):
        embedder = local_engine(app).model.embedder
        assert embedder is not None and embedder.compiled is not None
        runs = graph_runs(embedder, monkeypatch)
        monkeypatch.setattr(embedder.compiled, "padded_batches", True)
        single = await client.post("/embed", json={"inputs": TEXTS[0]})
        batch = await client.post("/embed", json={"inputs": TEXTS})
    assert single.status_code == batch.status_code == 200
    assert len(runs) == 2  # each request's pass on a graph
    assert np.abs(np.array(single.json()) - reference(tiny_embedder, TEXTS[:1])).max() <= 1e-5
    assert np.abs(np.array(batch.json()) - reference(tiny_embedder, TEXTS)).max() <= 1e-5


async def test_embed_takes_token_ids(placement: Placement, tiny_checkpoint: Path) -> None:
    ids = [2, TINY_VOCAB.index("hello"), TINY_VOCAB.index("world"), 3]
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        by_text = (await client.post("/embed", json={"inputs": "hello world"})).json()
        by_ids = (await client.post("/embed", json={"inputs": ids})).json()
        mixed = (await client.post("/embed", json={"inputs": ["hello world", ids]})).json()
    assert np.allclose(by_text, by_ids, atol=1e-6)
    assert np.allclose(mixed[0], mixed[1], atol=1e-6)


async def test_embed_all_returns_per_token_vectors(
    placement: Placement, tiny_checkpoint: Path, tiny_embedder: Embedder
) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        response = await client.post("/embed_all", json={"inputs": TEXTS})
    assert response.status_code == 200
    body = response.json()
    expected = tiny_embedder.forward(
        [e.ids for e in tiny_embedder.tokenize(TEXTS)], token_embeddings=True
    ).token_embeddings
    assert expected is not None
    for got, want in zip(body, expected, strict=True):
        assert np.array(got).shape == tuple(want.shape)  # no padding rows
        assert np.abs(np.array(got) - want.numpy()).max() <= 1e-5


async def test_tokenize_has_tei_shape(placement: Placement, tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        response = await client.post("/tokenize", json={"inputs": "Hello, world"})
        plain = await client.post(
            "/tokenize", json={"inputs": ["Hello"], "add_special_tokens": False}
        )
    assert response.status_code == 200
    [tokens] = response.json()
    assert tokens[0] == {"id": 2, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[1] == {
        "id": TINY_VOCAB.index("hello"),
        "text": "Hello",
        "special": False,
        "start": 0,
        "stop": 5,
    }
    assert [t["text"] for t in tokens] == ["[CLS]", "Hello", ",", "world", "[SEP]"]
    assert [t["text"] for t in plain.json()[0]] == ["Hello"]


async def test_openai_shape_float_and_base64(placement: Placement, tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        floats = await client.post("/v1/embeddings", json={"input": TEXTS, "model": "any"})
        packed = await client.post(
            "/v1/embeddings",
            json={"input": TEXTS, "model": "any", "encoding_format": "base64", "dimensions": 16},
        )
    body = floats.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list"
    assert body["model"] == str(tiny_checkpoint)
    assert [set(item) for item in body["data"]] == [{"object", "index", "embedding"}] * 2
    assert [item["object"] for item in body["data"]] == ["embedding", "embedding"]
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    decoded = [
        np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        for item in packed.json()["data"]
    ]
    full = np.array([item["embedding"] for item in body["data"]], dtype=np.float32)
    for vector, row in zip(decoded, full, strict=True):
        assert vector.shape == (16,)
        cut = row[:16] / np.linalg.norm(row[:16])
        assert np.abs(vector - cut).max() <= 1e-5


async def test_the_openai_client_works_unchanged(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    async with running_app(make_settings(tiny_checkpoint, api_key="s3cret"), placement) as (
        _,
        client,
    ):
        api = openai.AsyncOpenAI(api_key="s3cret", base_url="http://test/v1", http_client=client)
        result = await api.embeddings.create(input=TEXTS, model="tiny")  # base64 by default
        cut = await api.embeddings.create(
            input="hello", model="tiny", dimensions=8, encoding_format="float"
        )
        plain = (
            await client.post(
                "/v1/embeddings", json={"input": TEXTS}, headers={"authorization": "Bearer s3cret"}
            )
        ).json()
    assert len(result.data) == 2
    assert np.allclose(result.data[1].embedding, plain["data"][1]["embedding"], atol=1e-6)
    assert len(cut.data[0].embedding) == 8
    assert result.usage.total_tokens == plain["usage"]["total_tokens"]


async def test_encode_returns_everything_asked_for(
    placement: Placement, tiny_checkpoint: Path, tiny_embedder: Embedder
) -> None:
    request = {
        "inputs": ["hello world", [2, 40, 3]],
        "token_embeddings": True,
        "attention": {"layers": [-1], "heads": [0, 2]},
        "dimensions": 4,
    }
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        response = await client.post("/encode", json=request)
        mean = await client.post(
            "/encode",
            json={
                "inputs": "hello world",
                "attention": {"reduce": "mean"},
                "encoding": "base64",
                "tokens": False,
                "pooled": False,
            },
        )
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["total_tokens"] == 7
    first, second = body["data"]
    assert first["index"] == 0 and first["truncated"] is False
    assert np.array(first["embedding"]).shape == (4,)
    assert np.array(first["token_embeddings"]).shape == (4, 32)
    assert first["tokens"][1] == {
        "id": TINY_VOCAB.index("hello"),
        "text": "hello",
        "start": 0,
        "end": 5,
        "special": False,
    }
    assert second["tokens"][1]["start"] is None  # token-id input has no offsets
    [attention] = first["attention"]
    assert attention["layer"] == 1 and attention["heads"] == [0, 2]
    maps = np.array(attention["values"])
    assert maps.shape == (2, 4, 4)
    want = tiny_embedder.forward(
        tiny_embedder.tokenize(["hello world"]), attention=AttentionSpec((1,), (0, 2))
    ).attentions
    assert want is not None
    assert np.abs(maps - want[0][1].numpy()).max() <= 1e-5
    mean_body = mean.json()["data"][0]
    assert "embedding" not in mean_body and "tokens" not in mean_body
    assert [a["layer"] for a in mean_body["attention"]] == [0, 1]
    packed = mean_body["attention"][0]["values"]
    assert packed["dtype"] == "float32" and packed["shape"] == [4, 4]
    values = np.frombuffer(base64.b64decode(packed["data"]), dtype="<f4").reshape(4, 4)
    assert np.allclose(values.sum(axis=1), 1.0, atol=1e-5)
    layer0 = tiny_embedder.forward(
        tiny_embedder.tokenize(["hello world"]), attention=AttentionSpec((0,), (0, 1, 2, 3))
    ).attentions
    assert layer0 is not None
    assert np.abs(values - layer0[0][0].numpy().mean(axis=0)).max() <= 1e-5


async def test_operations_routes(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint, max_queue_wait=7.5)) as (_, client):
        info = (await client.get("/info")).json()
        health = await client.get("/health")
        live = await client.get("/live")
        await client.post("/embed", json={"inputs": TEXTS})
        metrics = (await client.get("/metrics")).text
        docs = (await client.get("/openapi.json")).json()
    assert info["dimensions"] == 32 and info["max_input_tokens"] == 48
    assert info["pooling"] == ["mean"] and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["hidden_size"] == 32 and info["dense"] == [] and info["include_prompt"]
    assert info["limits"]["max_batch_tokens"] > 0
    assert info["version"] == version("embedding-server")  # the installed package's metadata
    assert info["limits"]["max_queue_wait"] == 7.5
    assert health.json() == {"status": "ok"} and live.json() == {"status": "ok"}
    for name in (
        "embed_requests_total",
        "embed_failures_total",
        "embed_inputs_total",
        "embed_tokens_total",
        "embed_queue_depth",
        "embed_batch_size_bucket",
        "embed_batch_tokens_bucket",
        "embed_padding_ratio_bucket",
        "embed_tokenization_duration_seconds_bucket",
        "embed_queue_duration_seconds_bucket",
        "embed_inference_duration_seconds_bucket",
        "embed_request_duration_seconds_bucket",
        "embed_input_tokens_bucket",
        "embed_model_info",
    ):
        assert name in metrics, name
    assert 'embed_requests_total{route="/embed",status="200"} 1.0' in metrics
    assert re.search(r'^embed_inputs_total\{model="[^"]+tiny"\} 2.0$', metrics, re.M)
    # The queue's wait per request (two inputs here), as every placement's front end sees it.
    assert re.search(
        r'^embed_queue_duration_seconds_count\{model="[^"]+tiny"\} 1.0$', metrics, re.M
    )
    # The passes' CPU time (one thread's): some, and never more than their duration.
    cpu = re.search(r'^embed_forward_cpu_seconds_total\{model="[^"]+"\} (\S+)$', metrics, re.M)
    wall = re.search(
        r'^embed_inference_duration_seconds_sum\{model="[^"]+"\} (\S+)$', metrics, re.M
    )
    assert cpu is not None and wall is not None
    assert 0 < float(cpu.group(1)) <= float(wall.group(1)) + 1e-3
    for path in ("/embed", "/embed_all", "/tokenize", "/v1/embeddings", "/encode", "/info"):
        assert {"413", "422", "429", "503", "504"} <= set(
            docs["paths"][path]["post" if path != "/info" else "get"]["responses"]
        )


async def test_truncation_follows_request_and_server_default(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    long_text = " ".join(["hello world"] * 40)
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        cut = await client.post(
            "/encode", json={"inputs": long_text, "truncation_direction": "Left"}
        )
        refused = await client.post("/embed", json={"inputs": long_text, "truncate": False})
    assert cut.status_code == 200
    assert cut.json()["data"][0]["truncated"] is True
    assert len(cut.json()["data"][0]["tokens"]) == 48
    assert refused.status_code == 422
    assert "82 tokens" in refused.json()["error"] and "48" in refused.json()["error"]
    async with running_app(make_settings(tiny_checkpoint, auto_truncate=False), placement) as (
        _,
        client,
    ):
        assert (await client.post("/embed", json={"inputs": long_text})).status_code == 422


async def test_prompt_name_prepends_the_models_prompt(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    import json

    (tiny_checkpoint / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "the "}})
    )
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        prompted = (
            await client.post("/embed", json={"inputs": "fox", "prompt_name": "query"})
        ).json()
        written = (await client.post("/embed", json={"inputs": "the fox"})).json()
        info = (await client.get("/info")).json()
    assert info["prompts"] == {"query": "the "}
    assert np.allclose(prompted, written, atol=1e-6)
