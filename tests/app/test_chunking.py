"""Chunked embedding of long texts: chunks cover the text within their size, `independent`
equals /embed of each chunk's text, `late` equals a reference pooled from `transformers`'
hidden states (within the model's limit and in windows past it), and a long document is
answered within the limits or refused with 413."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from sentence_transformers.util.quantization import quantize_embeddings

from app.chunking import Chunk, Content, late_windows, plan_chunks
from model.tokenizer import Encoded, TextTokenizer, TokenDetails
from tests.app.conftest import Placement, make_settings, running_app
from tests.helpers import (
    TINY_VOCAB,
    make_random_checkpoint,
    tiny_tokenizer,
    write_sentence_transformers_files,
)
from tests.model.test_parity_transformers import save_reference
from tests.task_checkpoints import labelled, save_task_model

pytestmark = pytest.mark.anyio
SENTENCES = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world, hello again!",
    "a lazy dog is a happy dog?",
    "the brown dog and the quick fox",
]
DOCUMENT = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(30))
# Cosine between a chunk's vector and its reference.
COSINE = 0.99999
# The reference model's limit (save_reference writes max_seq_length 60).
LIMIT = 60


def cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    result: np.ndarray = np.sum(got * expected, axis=1)
    return result


async def test_chunks_cover_the_text_within_their_size(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        body = {"inputs": DOCUMENT, "chunking": {"mode": "independent", "size": 24, "overlap": 5}}
        chunks = (await client.post("/embed_chunks", json=body)).json()[0]
    covered = np.zeros(len(DOCUMENT), dtype=bool)
    for chunk in chunks:
        assert 0 < chunk["tokens"] <= 24
        covered[chunk["start"] : chunk["end"]] = True
    assert all(covered[i] for i, char in enumerate(DOCUMENT) if not char.isspace())
    for before, after in itertools.pairwise(chunks):
        assert after["start"] < before["end"], "consecutive chunks overlap"
    # A sentence ends in the second half of every chunk, so every chunk but the last ends
    # at one.
    assert all(DOCUMENT[chunk["end"] - 1] in ".!?" for chunk in chunks[:-1])


@pytest.mark.parametrize("prompt_length", [0, 4])
def test_late_windows_lay_the_whole_text_end_to_end(prompt_length: int) -> None:
    ids = [101, *range(prompt_length), *range(1000, 1300), 102]
    special = [True] + [False] * (len(ids) - 2) + [True]
    # The prompt's tokens cover characters 0-3 (one each), the text's the ones after.
    offsets = [(0, 0), *[(i, i + 1) for i in range(len(ids) - 2)], (0, 0)]
    encoded = Encoded(
        ids,
        False,
        prompt_length + 1 if prompt_length else 0,
        details=TokenDetails([], offsets, special),
    )
    content = Content.of(encoded, prompt_chars=prompt_length)
    assert content.first == 1 + prompt_length and content.stop == len(ids) - 1
    windows, plan = late_windows(encoded, content, [], 64)
    assert all(len(window.ids) == 64 for window in windows)
    laid = [i for window, (a, b) in zip(windows, plan.keeps, strict=True) for i in window.ids[a:b]]
    assert laid == ids
    for window in windows:  # each window starts with the prompt and ends with [SEP]
        assert window.ids[: content.first] == ids[: content.first]
        assert window.ids[-1] == 102


def chunks_of(text: str, size: int, overlap: int = 0) -> list[Chunk]:
    encoded = TextTokenizer(tiny_tokenizer().to_str(), 48, len(TINY_VOCAB)).encode_whole(text)
    content = Content.of(encoded, 0)
    return plan_chunks(encoded, content, text, 0, (size, overlap), 1000)


def test_a_chunk_ends_at_a_sentence_else_at_a_word() -> None:
    chinese = "你好。我们走吧。好的"  # no space after a full-width full stop
    assert [(c.start, c.end) for c in chunks_of(chinese, 5)] == [(0, 3), (3, 8), (8, 10)]
    words = "abc abc abc abc abc"  # each word three WordPiece tokens: a ##b ##c
    assert [(c.start, c.end) for c in chunks_of(words, 7)] == [(0, 7), (8, 15), (16, 19)]


def test_a_large_overlap_still_moves_on() -> None:
    """An overlap near the size gives many chunks, never two of the same start."""
    text = " ".join(SENTENCES * 3)
    chunks = chunks_of(text, 20, 15)
    starts = [chunk.first for chunk in chunks]
    assert starts == sorted(set(starts))
    assert all(chunk.tokens <= 20 for chunk in chunks)


async def test_independent_equals_embed_of_each_chunk_text(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        body = {"inputs": [DOCUMENT, SENTENCES[1]], "chunking": {"mode": "independent", "size": 16}}
        answer = (await client.post("/embed_chunks", json=body)).json()
        texts = [DOCUMENT, SENTENCES[1]]
        for text, chunks in zip(texts, answer, strict=True):
            pieces = [text[chunk["start"] : chunk["end"]] for chunk in chunks]
            expected = np.array((await client.post("/embed", json={"inputs": pieces})).json())
            got = np.array([chunk["embedding"] for chunk in chunks])
            assert cosines(got, expected).min() >= COSINE
        assert len(answer[1]) == 1


def late_reference(reference: Any, text: str, chunks: list[dict[str, Any]]) -> np.ndarray:
    """Each chunk's mean of `transformers`' token vectors of the whole text, normalised. Past
    the model's limit the text runs in windows of the model's length, each with [CLS] and
    [SEP], a quarter overlapping the next, the last flush with the text's end; each token's
    vector comes from the window whose centre is nearest (the later one on a tie)."""
    encoding = tiny_tokenizer().encode(text)
    ids, offsets = encoding.ids, encoding.offsets
    width = LIMIT - 2
    content = len(ids) - 2
    if len(ids) <= LIMIT:
        starts = [0]
        windows = [ids]
    else:
        starts = [*range(1, 1 + content - width, width - width // 4), 1 + content - width]
        windows = [[ids[0], *ids[s : s + width], ids[-1]] for s in starts]
    with torch.no_grad():
        states = [
            reference(input_ids=torch.tensor([window])).last_hidden_state[0].numpy()
            for window in windows
        ]
    token_vectors = []
    for position in range(len(ids)):
        if len(windows) == 1:
            token_vectors.append(states[0][position])
            continue
        centres = [s + width / 2 for s in starts]
        nearest = min(range(len(starts)), key=lambda k: (abs(position - centres[k]), -k))
        local = min(max(position - starts[nearest] + 1, 0), LIMIT - 1)
        token_vectors.append(states[nearest][local])
    vectors = []
    for chunk in chunks:
        inside = [
            p
            for p, (start, end) in enumerate(offsets)
            if not encoding.special_tokens_mask[p]
            and chunk["start"] <= start
            and end <= chunk["end"]
        ]
        assert len(inside) == chunk["tokens"]
        vectors.append(np.mean([token_vectors[p] for p in inside], axis=0))
    result = np.array(vectors)
    normalised: np.ndarray = result / np.linalg.norm(result, axis=1, keepdims=True)
    return normalised


@pytest.mark.parametrize("text", [" ".join(SENTENCES[:3]), DOCUMENT], ids=["whole", "windows"])
async def test_late_equals_a_reference_from_transformers(
    placement: Placement, tmp_path: Path, text: str
) -> None:
    reference = save_reference(tmp_path, "bert")
    async with running_app(make_settings(tmp_path), placement) as (_, client):
        body = {"inputs": text, "chunking": {"mode": "late", "size": 12, "overlap": 3}}
        chunks = (await client.post("/embed_chunks", json=body)).json()[0]
        encode = (await client.post("/encode", json={**body, "tokens": False})).json()
    assert len(chunks) > 1
    got = np.array([chunk["embedding"] for chunk in chunks])
    expected = late_reference(reference, text, chunks)
    assert np.abs(got - expected).max() < 1e-5
    assert encode["data"][0]["chunks"] == chunks
    # The encoder ran the whole text once, and the overlaps of its windows again.
    tokens = len(tiny_tokenizer().encode(text).ids)
    if tokens <= LIMIT:
        assert encode["usage"]["total_tokens"] == tokens
    else:
        assert encode["usage"]["total_tokens"] > tokens


async def test_late_differs_from_independent(tiny_checkpoint: Path) -> None:
    """Each late chunk has seen its context: its vector is not the chunk's alone."""
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        vectors = {}
        for mode in ("late", "independent"):
            body = {"inputs": DOCUMENT, "chunking": {"mode": mode, "size": 16}}
            answer = (await client.post("/embed_chunks", json=body)).json()[0]
            vectors[mode] = np.array([chunk["embedding"] for chunk in answer])
    assert vectors["late"].shape == vectors["independent"].shape
    # Alike they would be to rounding (1e-6); how far each moves depends on the weights.
    distances = np.linalg.norm(vectors["late"] - vectors["independent"], axis=1)
    assert distances.min() > 1e-3
    assert cosines(vectors["late"], vectors["independent"]).mean() < 0.999


async def test_a_document_of_100000_characters_is_answered_or_refused_with_413(
    placement: Placement, tiny_checkpoint: Path
) -> None:
    document = (DOCUMENT + " ") * (100_000 // len(DOCUMENT) + 1)
    document = document[:100_000]
    settings = make_settings(tiny_checkpoint, max_chunks_per_input=100_000)
    async with running_app(settings, placement) as (_, client):
        for mode in ("late", "independent"):
            body = {"inputs": document, "chunking": {"mode": mode}}
            response = await client.post("/embed_chunks", json=body, timeout=120)
            assert response.status_code == 200, response.text
            chunks = response.json()[0]
            assert chunks[0]["start"] == 0
            assert chunks[-1]["end"] == len(document.rstrip())
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        response = await client.post("/embed_chunks", json={"inputs": document})
        assert response.status_code == 413
        assert "makes more than 512 chunks, the limit per input" in response.json()["error"]
        assert (await client.post("/embed", json={"inputs": "hello"})).status_code == 200


async def test_chunk_codes_are_quantize_embeddings_of_the_floats(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        body: dict[str, Any] = {"inputs": DOCUMENT, "chunking": {"size": 16}}
        floats = (await client.post("/embed_chunks", json=body)).json()[0]
        info = (await client.get("/info")).json()["quantization"]
        codes = (await client.post("/embed_chunks", json={**body, "encoding": "int8"})).json()[0]
        packed = (await client.post("/encode", json={**body, "quantize": "binary"})).json()
        base64 = (await client.post("/encode", json={**body, "encoding": "base64"})).json()
    vectors = np.array([chunk["embedding"] for chunk in floats], dtype=np.float32)
    ranges = np.array([info["min"], info["max"]], dtype=np.float32)
    expected = quantize_embeddings(vectors, "int8", ranges=ranges)
    assert [chunk["embedding"] for chunk in codes] == expected.tolist()
    bits = quantize_embeddings(vectors, "binary").tolist()
    assert [chunk["embedding"] for chunk in packed["data"][0]["chunks"]] == bits
    first = base64["data"][0]["chunks"][0]["embedding"]
    assert first["shape"] == [vectors.shape[1]]


async def test_chunking_refuses_what_it_cannot_do(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint, max_chunks_per_request=10)
    cases: list[tuple[dict[str, Any], str, int, str]] = [
        ({"inputs": [[5, 6, 7]]}, "/encode", 422, "texts, not token ids"),
        (
            {"inputs": "hello", "chunking": {"size": 8, "overlap": 8}},
            "/embed_chunks",
            422,
            "overlap 8 must be below",
        ),
        ({"inputs": "hello", "token_embeddings": True}, "/encode", 422, "token_embeddings"),
        ({"inputs": ""}, "/embed_chunks", 400, "empty"),
        (
            {"inputs": [DOCUMENT] * 2, "chunking": {"size": 8}},
            "/embed_chunks",
            413,
            "more than 10 chunks, the limit per request",
        ),
        ({"inputs": "hello", "chunking": {"mode": "fast"}}, "/embed_chunks", 422, "mode"),
        ({"inputs": "hello", "prompt_name": "nope"}, "/embed_chunks", 422, "unknown prompt_name"),
    ]
    async with running_app(settings) as (_, client):
        for body, path, status, message in cases:
            if path == "/encode":
                body = {**body, "chunking": {}}
            response = await client.post(path, json=body)
            assert response.status_code == status, (body, response.text)
            assert message in response.text, (body, response.text)
            assert "Traceback" not in response.text


@pytest.mark.parametrize("mode", ["late", "independent"])
async def test_chunked_work_counts_against_the_request_token_limit(
    tiny_checkpoint: Path, mode: str
) -> None:
    """What the encoder would run for a chunked text (its windows, or each chunk with its
    special tokens) is held to max_request_tokens like any request's tokens."""
    settings = make_settings(tiny_checkpoint, max_request_tokens=64)
    body = {"inputs": DOCUMENT, "chunking": {"mode": mode, "size": 8}}
    async with running_app(settings) as (_, client):
        refused = await client.post("/embed_chunks", json=body)
        short = await client.post("/embed_chunks", json={**body, "inputs": "hello world"})
    assert refused.status_code == 413, refused.text
    assert "more than the limit of 64" in refused.text, refused.text
    assert short.status_code == 200


async def test_a_classifier_refuses_chunking_with_424(tmp_path: Path) -> None:
    save_task_model(tmp_path, transformers.BertForSequenceClassification, "bert", **labelled(1))
    async with running_app(make_settings(tmp_path)) as (_, client):
        response = await client.post("/embed_chunks", json={"inputs": DOCUMENT})
        assert response.status_code == 424, response.text
        encode = await client.post(
            "/encode", json={"inputs": DOCUMENT, "pooled": False, "chunking": {}}
        )
        assert encode.status_code == 424, encode.text


async def test_a_chunk_holds_no_more_than_the_model_takes(tiny_checkpoint: Path) -> None:
    """A size over the model's limit is capped there (each chunk can be embedded alone), the
    overlap keeping its share; a text with no token of its own (whitespace, control
    characters) has no chunk."""
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        body = {"inputs": [DOCUMENT, " \u0005 "], "chunking": {"size": 500, "overlap": 100}}
        answer = (await client.post("/embed_chunks", json=body)).json()
        late = {"mode": "late"}
        empty = (await client.post("/embed_chunks", json={"inputs": "\t", "chunking": late})).json()
    tokens = [chunk["tokens"] for chunk in answer[0]]
    assert max(tokens) <= 48 - 2  # [CLS] and [SEP]
    assert len(tokens) < 2 * len(tiny_tokenizer().encode(DOCUMENT).ids) / 46 + 2
    assert answer[1] == []
    assert empty == [[]]


async def test_chunks_with_a_prompt_count_from_the_text_as_sent(tmp_path: Path) -> None:
    """The prompt runs before each chunk (independent) or the whole text (late), and the
    offsets count in the text as sent."""
    folder = tmp_path / "prompted"
    make_random_checkpoint(folder)
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "the quick "}})
    )
    text = " ".join(SENTENCES)
    async with running_app(make_settings(folder)) as (_, client):
        for mode in ("independent", "late"):
            body = {"inputs": text, "prompt_name": "query", "chunking": {"mode": mode, "size": 8}}
            chunks = (await client.post("/embed_chunks", json=body)).json()[0]
            assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(text)
            assert text[chunks[0]["start"] : chunks[0]["end"]].startswith("the quick brown")
            if mode == "independent":
                pieces = [text[c["start"] : c["end"]] for c in chunks]
                embed = {"inputs": pieces, "prompt_name": "query"}
                expected = np.array((await client.post("/embed", json=embed)).json())
                got = np.array([c["embedding"] for c in chunks])
                assert cosines(got, expected).min() >= COSINE


async def test_late_chunks_are_cut_and_normalised_as_asked(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        body: dict[str, Any] = {"inputs": DOCUMENT, "chunking": {"size": 16}, "normalize": False}
        whole = np.array(
            [c["embedding"] for c in (await client.post("/embed_chunks", json=body)).json()[0]]
        )
        cut = (
            await client.post("/embed_chunks", json={**body, "dimensions": 8, "normalize": True})
        ).json()[0]
    expected = whole[:, :8] / np.linalg.norm(whole[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(np.array([c["embedding"] for c in cut]), expected, atol=1e-6)
    assert not np.allclose(np.linalg.norm(whole, axis=1), 1.0)


async def test_late_chunking_refuses_a_model_that_pools_one_token(tmp_path: Path) -> None:
    folder = tmp_path / "cls"
    make_random_checkpoint(folder)
    write_sentence_transformers_files(folder, pooling="cls")
    async with running_app(make_settings(folder)) as (_, client):
        late = await client.post("/embed_chunks", json={"inputs": DOCUMENT})
        alone = await client.post(
            "/embed_chunks", json={"inputs": DOCUMENT, "chunking": {"mode": "independent"}}
        )
    assert late.status_code == 422 and "pools by cls" in late.json()["error"]
    assert alone.status_code == 200


@pytest.mark.parametrize("mode", ["independent", "late"])
async def test_a_chunked_request_is_one_tokenizing_in_the_metrics(
    tiny_checkpoint: Path, mode: str
) -> None:
    """Independent chunks tokenize twice (the whole text, then each chunk's piece): one
    observation of their sum, as the help says "tokenizing one request"."""
    body = {"inputs": " ".join(["hello world"] * 40), "chunking": {"size": 16, "mode": mode}}
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        assert (await client.post("/embed_chunks", json=body)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert re.search(r"^embed_tokenization_duration_seconds_count\{[^}]*\} 1.0$", metrics, re.M)
