"""Compact vectors per request: /embed's `encoding` and /v1/embeddings' `encoding_format` give
sentence-transformers' quantize_embeddings of the float vectors, on the ranges /info
publishes; a vector's codes never depend on what else is in the request or the batch."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from model.quantization import builtin_calibration_texts
from tests.app.conftest import Placement, make_settings, running_app, service_of

pytestmark = pytest.mark.anyio
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "é", "lazy dog"]
PRECISIONS = ["int8", "uint8", "binary", "ubinary"]


async def test_every_encoding_is_quantize_embeddings_on_the_published_ranges(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        floats = np.array((await client.post("/embed", json={"inputs": TEXTS})).json())
        info = (await client.get("/info")).json()
        codes = {
            precision: (
                await client.post("/embed", json={"inputs": TEXTS, "encoding": precision})
            ).json()
            for precision in PRECISIONS
        }
        openai = {
            precision: (
                await client.post(
                    "/v1/embeddings", json={"input": TEXTS, "encoding_format": precision}
                )
            ).json()
            for precision in PRECISIONS
        }
    quantization = info["quantization"]
    assert quantization["calibration_texts"] == len(builtin_calibration_texts())
    ranges = np.array([quantization["min"], quantization["max"]], dtype=np.float32)
    assert ranges.shape == (2, 32)
    for precision in PRECISIONS:
        expected = quantize_embeddings(floats.astype(np.float32), precision, ranges=ranges)
        assert codes[precision] == expected.tolist(), precision
        assert [item["embedding"] for item in openai[precision]["data"]] == expected.tolist()


async def test_base64_and_binary_round_trip_to_the_float_vectors(tiny_checkpoint: Path) -> None:
    """base64 decodes to /embed's float32 vectors exactly, on /embed and /embed_chunks; the
    bits of ubinary, unpacked, are the floats' signs (positive: 1), and binary is the same
    bytes shifted by -128."""
    chunking = {"inputs": TEXTS[1], "chunking": {"mode": "independent", "size": 4}}
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        floats = np.array((await client.post("/embed", json={"inputs": TEXTS})).json())
        encoded = await client.post("/embed", json={"inputs": TEXTS, "encoding": "base64"})
        ubinary = await client.post("/embed", json={"inputs": TEXTS, "encoding": "ubinary"})
        binary = await client.post("/embed", json={"inputs": TEXTS, "encoding": "binary"})
        chunks = (await client.post("/embed_chunks", json=chunking)).json()[0]
        chunks64 = await client.post("/embed_chunks", json=chunking | {"encoding": "base64"})
    decoded = np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in encoded.json()])
    assert np.array_equal(decoded, floats.astype(np.float32))
    bits = np.unpackbits(np.array(ubinary.json(), dtype=np.uint8), axis=1)
    assert np.array_equal(bits, (floats > 0).astype(np.uint8))
    assert np.array_equal(np.array(binary.json()), np.array(ubinary.json()) - 128)
    assert len(chunks) > 1
    for chunk, coded in zip(chunks, chunks64.json()[0], strict=True):
        assert (chunk["start"], chunk["end"]) == (coded["start"], coded["end"])
        vector = np.frombuffer(base64.b64decode(coded["embedding"]), dtype="<f4")
        assert np.array_equal(vector, np.array(chunk["embedding"], dtype=np.float32))


async def test_codes_do_not_depend_on_the_rest_of_the_request(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        alone = await client.post("/embed", json={"inputs": "lazy dog", "encoding": "int8"})
        among = await client.post("/embed", json={"inputs": TEXTS, "encoding": "int8"})
    assert alone.json()[0] == among.json()[3]


async def test_cut_and_unnormalised_vectors_use_ranges_finished_the_same_way(
    tiny_checkpoint: Path,
) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        body = {"inputs": TEXTS, "dimensions": 8, "normalize": False}
        floats = np.array((await client.post("/embed", json=body)).json(), dtype=np.float32)
        codes = (await client.post("/embed", json=body | {"encoding": "uint8"})).json()
        calibration = service_of(app).calibration
    assert calibration is not None
    ranges = calibration.ranges(normalize=False, dimensions=8)
    assert codes == quantize_embeddings(floats, "uint8", ranges=ranges).tolist()
    assert np.array(codes).shape == (4, 8)


async def test_the_operators_calibration_file_sets_the_ranges(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    texts = tmp_path / "calibration.txt"
    texts.write_text("hello\nworld\nthe quick brown fox\n", encoding="utf-8")
    settings = make_settings(tiny_checkpoint, calibration_file=texts)
    async with running_app(settings) as (_, client):
        quantization = (await client.get("/info")).json()["quantization"]
        floats = await client.post("/embed", json={"inputs": texts.read_text().split("\n")[:3]})
    assert quantization["calibration_texts"] == 3
    vectors = np.array(floats.json(), dtype=np.float32)
    assert np.allclose(quantization["min"], vectors.min(axis=0), atol=1e-6)
    assert np.allclose(quantization["max"], vectors.max(axis=0), atol=1e-6)


async def test_calibration_keeps_to_the_batch_limits(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint, max_batch_inputs=2, max_batch_tokens=64)
    async with running_app(settings) as (_, client):
        quantization = (await client.get("/info")).json()["quantization"]
    assert quantization["calibration_texts"] == len(builtin_calibration_texts())


async def test_an_unknown_encoding_is_a_422(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post("/embed", json={"inputs": "a", "encoding": "int4"})
        openai = await client.post("/v1/embeddings", json={"input": "a", "encoding_format": "x"})
    assert response.status_code == 422
    assert response.json()["error"] == (
        "encoding: Input should be 'float', 'base64', 'int8', 'uint8', 'binary' or 'ubinary'"
    )
    assert openai.status_code == 422
    assert openai.json()["error"]["param"] == "encoding_format"


async def test_encode_gives_the_pooled_vector_as_codes_beside_float_token_vectors(
    tiny_checkpoint: Path,
) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        codes = (await client.post("/embed", json={"inputs": TEXTS, "encoding": "binary"})).json()
        body = {"inputs": TEXTS, "quantize": "binary", "token_embeddings": True}
        encoded = (await client.post("/encode", json=body)).json()
    assert [item["embedding"] for item in encoded["data"]] == codes
    assert all(isinstance(item["token_embeddings"][0][0], float) for item in encoded["data"])


async def test_encode_without_a_pooled_vector_has_nothing_to_quantize(
    tiny_checkpoint: Path,
) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        body = {"inputs": "hello", "pooled": False, "quantize": "int8", "token_embeddings": True}
        response = await client.post("/encode", json=body)
    assert response.status_code == 200
    assert "embedding" not in response.json()["data"][0]
