"""The clients people already use, unchanged, against the real server process on loopback.

Each gets the same vectors as a direct /embed call (max abs difference <= 1e-6).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import cohere
import httpx
import numpy as np
import openai
import pytest
from huggingface_hub import InferenceClient
from langchain_huggingface import HuggingFaceEndpointEmbeddings
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

from tests.app.test_server_process import ServerProcess

TEXTS = ["The cat sits on the mat.", "A dog plays in the park.", "Größe 東京 🚀"]
TOLERANCE = 1e-6


@pytest.fixture(scope="module", params=["in-process", "split"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """The real server with the engine in its process, and in one of its own."""
    folder = tmp_path_factory.mktemp("clients")
    process = ServerProcess(folder, "--dtype", "float32", "--placement", request.param)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def direct(server: ServerProcess) -> np.ndarray:
    response = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=60)
    response.raise_for_status()
    return np.array(response.json(), dtype=np.float32)


def close(got: object, want: np.ndarray) -> bool:
    return float(np.abs(np.array(got, dtype=np.float32) - want).max()) <= TOLERANCE


def test_openai_client_float_and_base64(server: ServerProcess, direct: np.ndarray) -> None:
    client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1")
    packed = client.embeddings.create(input=TEXTS, model="any")  # base64 by default
    floats = client.embeddings.create(input=TEXTS, model="any", encoding_format="float")
    assert close([item.embedding for item in packed.data], direct)
    assert close([item.embedding for item in floats.data], direct)
    assert packed.model == "sentence-transformers/all-MiniLM-L6-v2"
    [card] = client.models.list().data
    assert card.id == packed.model


def test_cohere_sdk_gets_every_embedding_type(server: ServerProcess, direct: np.ndarray) -> None:
    """The official SDK's ClientV2, unchanged: floats as /embed gives them, and each compact
    type as /embed's `encoding` gives it."""
    kinds = ["float", "int8", "uint8", "binary", "ubinary"]
    with httpx.Client(timeout=60) as http:
        client = cohere.ClientV2(api_key="unused", base_url=server.url, httpx_client=http)
        response = client.embed(
            texts=TEXTS, model="any", input_type="search_document", embedding_types=kinds
        )
        cut = client.embed(
            texts=TEXTS[:1], model="any", input_type="search_query", output_dimension=8
        )
    assert close(response.embeddings.float_, direct)
    for kind in kinds[1:]:
        codes = httpx.post(
            f"{server.url}/embed", json={"inputs": TEXTS, "encoding": kind}, timeout=60
        ).json()
        assert getattr(response.embeddings, kind) == codes, kind
    assert response.texts == TEXTS
    assert response.meta is not None and response.meta.billed_units is not None
    assert (response.meta.billed_units.input_tokens or 0) > len(TEXTS)
    assert np.array(cut.embeddings.float_).shape == (1, 8)


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_openai_client_asks_for_codes_through_its_extra_body(
    server: ServerProcess, precision: str
) -> None:
    with openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1") as client:
        response = client.embeddings.create(
            input=TEXTS, model="any", extra_body={"encoding_format": precision}
        )
    codes = httpx.post(
        f"{server.url}/embed", json={"inputs": TEXTS, "encoding": precision}, timeout=60
    ).json()
    assert [item.embedding for item in response.data] == codes


def test_huggingface_hub_inference_client(server: ServerProcess, direct: np.ndarray) -> None:
    client = InferenceClient(base_url=server.url)  # posts to `POST /`
    assert close([client.feature_extraction(text)[0] for text in TEXTS], direct)
    scores = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    assert np.allclose(scores, direct[1:] @ direct[0], atol=1e-5)


def test_langchain_huggingface_endpoint(server: ServerProcess, direct: np.ndarray) -> None:
    embeddings = HuggingFaceEndpointEmbeddings(model=server.url)
    assert close(embeddings.embed_documents(TEXTS), direct)
    assert close(embeddings.embed_query(TEXTS[1]), direct[1])


def test_llama_index_text_embeddings_inference(server: ServerProcess, direct: np.ndarray) -> None:
    embeddings = TextEmbeddingsInference(model_name="any", base_url=server.url)
    assert close(embeddings.get_text_embedding_batch(TEXTS), direct)
    assert close(asyncio.run(embeddings.aget_query_embedding(TEXTS[2])), direct[2])


def test_server_logs_no_traceback(server: ServerProcess, tmp_path: Path) -> None:
    assert "Traceback" not in server.log.read_text()
