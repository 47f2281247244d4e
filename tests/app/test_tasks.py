"""Cross-encoders (/predict, /rerank) and sparse models (/embed_sparse), on tiny checkpoints
that `transformers` saves; every other route answers 424 for a model of the wrong kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from model.heads import Splade
from tests.app.conftest import Placement, make_settings, running_app
from tests.task_checkpoints import labelled, save_task_model, write_splade_folder

pytestmark = pytest.mark.anyio
QUERY = "the quick fox"
TEXTS = ["the lazy dog", "quick brown fox jumps", "hello world"]


def reference_logits(
    model: transformers.PreTrainedModel, pairs: list[tuple[str, str]]
) -> np.ndarray:
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model.name_or_path)
    batch = tokenizer(
        [a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits: np.ndarray = model(**batch).logits.numpy()
    return logits


@pytest.fixture
def reranker(tmp_path: Path) -> tuple[Path, transformers.PreTrainedModel]:
    folder = tmp_path / "reranker"
    model = save_task_model(
        folder, transformers.BertForSequenceClassification, "bert", num_labels=1
    )
    model.name_or_path = str(folder)
    return folder, model


@pytest.fixture
def classifier(tmp_path: Path) -> tuple[Path, transformers.PreTrainedModel]:
    folder = tmp_path / "classifier"
    model = save_task_model(
        folder, transformers.BertForSequenceClassification, "bert", **labelled(3)
    )
    model.name_or_path = str(folder)
    return folder, model


async def test_rerank_sorts_by_sigmoid_score(
    placement: Placement,
    reranker: tuple[Path, transformers.PreTrainedModel],
) -> None:
    folder, model = reranker
    want = reference_logits(model, [(QUERY, text) for text in TEXTS])[:, 0]
    async with running_app(make_settings(folder), placement) as (_, client):
        body = {"query": QUERY, "texts": TEXTS}
        ranked = await client.post("/rerank", json=body | {"return_text": True})
        raw = (await client.post("/rerank", json=body | {"raw_scores": True})).json()
        root = (await client.post("/", json=body)).json()
        info = (await client.get("/info")).json()
        embed = await client.post("/embed", json={"inputs": "hello"})
    assert ranked.status_code == 200
    ranks = ranked.json()
    assert [r["index"] for r in ranks] == list(np.argsort(-want))
    assert [r["text"] for r in ranks] == [TEXTS[r["index"]] for r in ranks]
    for rank in ranks:
        assert rank["score"] == pytest.approx(1 / (1 + np.exp(-want[rank["index"]])), abs=1e-5)
    assert {r["index"]: r["score"] for r in raw} == pytest.approx(dict(enumerate(want)), abs=1e-5)
    assert "text" not in raw[0]
    assert root == [{k: v for k, v in r.items() if k != "text"} for r in ranks]
    assert info["task"] == "classify" and info["labels"] == ["LABEL_0"]
    assert set(info["model_type"]) == {"reranker"}
    assert embed.status_code == 424 and embed.json()["error_type"] == "WrongModelType"


async def test_predict_takes_texts_pairs_and_batches(
    placement: Placement,
    classifier: tuple[Path, transformers.PreTrainedModel],
) -> None:
    folder, model = classifier
    labels = ["contradiction", "entailment", "neutral"]
    async with running_app(make_settings(folder), placement) as (_, client):
        single = (await client.post("/predict", json={"inputs": "hello world"})).json()
        pair = (await client.post("/predict", json={"inputs": [QUERY, TEXTS[0]]})).json()
        batch = await client.post(
            "/predict", json={"inputs": [[QUERY, TEXTS[0]], ["hello world"]], "raw_scores": True}
        )
        three = await client.post("/predict", json={"inputs": ["a", "b", "c"]})
        rerank = await client.post("/rerank", json={"query": QUERY, "texts": TEXTS})
    want = reference_logits(model, [(QUERY, TEXTS[0])])[0]
    probabilities = np.exp(want) / np.exp(want).sum()
    assert [p["label"] for p in pair] == [labels[i] for i in np.argsort(-probabilities)]
    assert [p["score"] for p in pair] == pytest.approx(
        sorted(probabilities, reverse=True), abs=1e-5
    )
    assert len(single) == 3 and sum(p["score"] for p in single) == pytest.approx(1, abs=1e-5)
    assert batch.status_code == 200
    first, second = batch.json()
    assert {p["label"]: p["score"] for p in first} == pytest.approx(
        dict(zip(labels, want.tolist(), strict=True)), abs=1e-5
    )
    assert len(second) == 3
    assert three.status_code == 422 and "one text or one pair" in three.json()["error"]
    assert rerank.status_code == 424 and "use /predict" in rerank.json()["error"]


async def test_embed_sparse_gives_the_splade_weights(placement: Placement, tmp_path: Path) -> None:
    folder = tmp_path / "splade"
    model = save_task_model(folder, transformers.BertForMaskedLM, "bert")
    write_splade_folder(folder, Splade())
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    weights = torch.log1p(torch.relu(logits)) * batch["attention_mask"].unsqueeze(-1)
    want = weights.max(dim=1).values.numpy()
    async with running_app(make_settings(folder), placement) as (_, client):
        sparse = await client.post("/embed_sparse", json={"inputs": TEXTS})
        root = (await client.post("/", json={"inputs": TEXTS})).json()
        info = (await client.get("/info")).json()
        dense = await client.post("/v1/embeddings", json={"input": "hello"})
    assert sparse.status_code == 200 and root == sparse.json()
    for row, entries in enumerate(sparse.json()):
        got = np.zeros(want.shape[1], dtype=np.float32)
        for entry in entries:
            got[entry["index"]] = entry["value"]
        assert np.abs(got - want[row]).max() <= 1e-5
        assert all(entry["value"] > 0 for entry in entries)
    assert info["task"] == "sparse" and info["model_type"] == {"embedding": {"pooling": "splade"}}
    assert dense.status_code == 424


async def test_task_routes_on_an_embedding_model_and_bad_inputs(
    placement: Placement, tiny_checkpoint: Path, reranker: tuple[Path, transformers.PreTrainedModel]
) -> None:
    async with running_app(make_settings(tiny_checkpoint), placement) as (_, client):
        for path, body in (
            ("/rerank", {"query": "a", "texts": ["b"]}),
            ("/predict", {"inputs": "a"}),
            ("/embed_sparse", {"inputs": "a"}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 424, path
            assert "the loaded model is an embedding model" in response.json()["error"]
    folder, _ = reranker
    async with running_app(make_settings(folder, max_inputs_per_request=2), placement) as (
        _,
        client,
    ):
        empty = await client.post("/rerank", json={"query": "a", "texts": []})
        blank = await client.post("/rerank", json={"query": "", "texts": ["b"]})
        many = await client.post("/rerank", json={"query": "a", "texts": ["b", "c", "d"]})
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"
    assert blank.status_code == 400
    assert many.status_code == 413 and "limit of 2" in many.json()["error"]
