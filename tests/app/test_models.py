"""Several models in one server: an embedding model, a cross-encoder and a SPLADE model, each
answering as it does alone, chosen by `/models/{name}/` or by the body's `model`; requests
to the three interleave without cross-talk, each model's 429 is its own, and start-up fails
with the name of a model that cannot load or fit the memory budget."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.__main__ import over_budget
from app.engine.local import LocalEngine
from app.settings import Settings
from model.footprint import weight_count
from model.resolve import resolve_model_dir
from tests.app.conftest import GatedForward, Placement, make_settings, running_app, wait_until
from tests.app.test_contract import checkpoint_of
from tests.app.test_server_process import free_port

pytestmark = pytest.mark.anyio
TEXTS = ["the quick brown fox", "hello world", "a lazy dog"]
# (name, checkpoint kind, requests: (route, body))
MODELS: list[tuple[str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        "embedder",
        "embedding",
        [
            ("/embed", {"inputs": TEXTS}),
            ("/embed_chunks", {"inputs": " ".join(TEXTS * 5), "chunking": {"size": 8}}),
            ("/encode", {"inputs": TEXTS[0], "token_embeddings": True}),
            ("/embed_all", {"inputs": TEXTS[:2]}),
            ("/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}}),
            ("/v2/embed", {"texts": TEXTS, "embedding_types": ["float", "int8"]}),
            ("/", {"inputs": TEXTS}),
            ("/tokenize", {"inputs": TEXTS[1]}),
            ("/decode", {"ids": [[2, 5, 6, 3]]}),
        ],
    ),
    (
        "reranker",
        "reranker",
        [
            ("/rerank", {"query": "a fox", "texts": TEXTS}),
            ("/predict", {"inputs": [["a fox", TEXTS[0]], ["a dog", TEXTS[2]]]}),
            ("/", {"query": "a fox", "texts": TEXTS}),
        ],
    ),
    ("splade", "splade", [("/embed_sparse", {"inputs": TEXTS}), ("/", {"inputs": TEXTS})]),
]
# An answer's own fields that differ between any two answers: the served name (alone, the
# folder) and Cohere's response id. Nested fields (a token's id) are all compared.
UNCOMPARED = frozenset({"model", "id"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: checkpoint_of(kind, root / name) for name, kind, _ in MODELS}


def several(folders: dict[str, Path], **overrides: Any) -> Settings:
    specs = [f"{name}={folder}" for name, folder in folders.items()]
    return make_settings(folders["embedder"], model_id=specs, **overrides)


def same(got: Any, expected: Any, top: bool = True) -> None:
    """Equal answers; floats to float32's rounding (the same model, another batch)."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-5)
    elif isinstance(expected, list):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            same(a, b, top=False)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            if not (top and key in UNCOMPARED):
                same(got[key], expected[key], top=False)
    else:
        assert got == expected


async def test_each_model_answers_as_it_does_alone(
    placement: Placement, folders: dict[str, Path]
) -> None:
    alone: dict[tuple[str, str], Any] = {}
    for name, _, requests in MODELS:
        async with running_app(make_settings(folders[name]), placement) as (_, client):
            for route, body in requests:
                response = await client.post(route, json=body)
                assert response.status_code == 200, response.text
                alone[name, route] = response.json()
    async with running_app(several(folders), placement) as (_, client):
        for name, _, requests in MODELS:
            for route, body in requests:
                response = await client.post(f"/models/{name}{route}", json=body)
                assert response.status_code == 200, (name, route, response.text)
                same(response.json(), alone[name, route])
        # The bare routes are the first model's; OpenAI's and Cohere's name theirs.
        same(
            (await client.post("/embed", json={"inputs": TEXTS})).json(),
            alone["embedder", "/embed"],
        )
        openai = await client.post("/v1/embeddings", json={"input": TEXTS, "model": "embedder"})
        assert openai.json()["model"] == "embedder"
        vectors = [item["embedding"] for item in openai.json()["data"]]
        same(vectors, alone["embedder", "/embed"])
        cohere = await client.post(
            "/v2/embed", json={"texts": TEXTS, "model": "embedder", "embedding_types": ["float"]}
        )
        same(cohere.json()["embeddings"]["float"], alone["embedder", "/embed"])
        listed = (await client.get("/v1/models")).json()["data"]
        assert [card["id"] for card in listed] == ["embedder", "reranker", "splade"]
        info = (await client.get("/models/reranker/info")).json()
        assert info["model_id"] == "reranker" and info["task"] == "classify"
        assert (await client.get("/info")).json()["model_id"] == "embedder"
        assert (await client.get("/models/splade/health")).status_code == 200


async def test_unknown_models_and_wrong_tasks_are_clear_errors(folders: dict[str, Path]) -> None:
    async with running_app(several(folders)) as (_, client):
        prefixed = await client.post("/models/nope/embed", json={"inputs": "a"})
        openai = await client.post("/v1/embeddings", json={"input": "a", "model": "nope"})
        cohere = await client.post("/v2/embed", json={"texts": ["a"], "model": "nope"})
        wrong = await client.post("/models/reranker/embed", json={"inputs": "a"})
        openai_prefixed = await client.post("/models/nope/v1/embeddings", json={"input": "a"})
    assert prefixed.status_code == 404
    # An OpenAI route answers in OpenAI's shape even under a name no model has.
    assert openai_prefixed.status_code == 404
    assert "/models/embedder/" in openai_prefixed.json()["error"]["message"]
    assert "/models/embedder/" in prefixed.json()["error"]
    assert openai.status_code == 404 and openai.json()["error"]["type"] == "invalid_request_error"
    assert "it serves 'embedder', 'reranker', 'splade'" in openai.json()["error"]["message"]
    assert cohere.status_code == 404
    assert wrong.status_code == 424 and "reranker" in wrong.json()["error"]


async def test_requests_to_three_models_interleave_without_cross_talk(
    placement: Placement, folders: dict[str, Path]
) -> None:
    async with running_app(several(folders), placement) as (_, client):
        expected = {
            (name, route): (await client.post(f"/models/{name}{route}", json=body)).json()
            for name, _, requests in MODELS
            for route, body in requests
        }
        calls = [
            (name, route, body)
            for _ in range(8)
            for name, _, requests in MODELS
            for route, body in requests
        ]
        answers = await asyncio.gather(
            *(client.post(f"/models/{name}{route}", json=body) for name, route, body in calls)
        )
        metrics = (await client.get("/metrics")).text
    for (name, route, _), answer in zip(calls, answers, strict=True):
        assert answer.status_code == 200
        same(answer.json(), expected[name, route])
    if placement == "in-process":  # the engines' own metrics are in their processes
        for name in ("embedder", "reranker", "splade"):
            assert re.search(rf'^embed_batch_size_count{{model="{name}"}} [1-9]', metrics, re.M)


async def test_each_model_has_its_own_queue_and_429(folders: dict[str, Path]) -> None:
    settings = several(folders, request_timeout=1.0, max_batch_inputs=1)
    async with running_app(settings) as (app, client):
        embedder = app.state.models["embedder"]
        assert isinstance(embedder.engine, LocalEngine)
        batcher = embedder.engine.model.batcher
        assert batcher is not None
        gate = GatedForward(embedder)
        held = await gate.hold(client)
        batcher._seconds, batcher._tokens = 0.01, 1.0  # 0.01 s per token: 100 tokens fit
        queued = [
            asyncio.create_task(client.post("/embed", json={"inputs": f"fox {i}"}))
            for i in range(24)
        ]
        await wait_until(lambda: batcher.depth == 24)
        refused = await client.post("/models/embedder/embed", json={"inputs": "fox"})
        other = await client.post("/models/reranker/rerank", json={"query": "a", "texts": ["b"]})
        batcher._seconds = 0.0
        gate.gate.set()
        await asyncio.gather(held, *queued)
    assert refused.status_code == 429
    assert other.status_code == 200


def test_a_model_that_cannot_load_fails_the_start_with_its_name(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    for placement, second in (("split", f"bad={broken}"), ("in-process", f"gone={tmp_path}/x")):
        started = subprocess.run(
            [
                sys.executable, "-m", "app", "--model-id", str(folders["embedder"]),
                "--model-id", second, "--placement", placement, "--devices", "cpu",
                "--host", "127.0.0.1", "--port", str(free_port()),
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert started.returncode == 1, started.stderr
        name = second.partition("=")[0]
        assert f"model {name}:" in started.stderr


def test_models_over_the_memory_budget_are_refused_by_name(folders: dict[str, Path]) -> None:
    """all-MiniLM-L6-v2's 22.7 M weights are 87 MiB in float32, half that in bfloat16."""
    minilm = resolve_model_dir("sentence-transformers/all-MiniLM-L6-v2")
    assert weight_count(minilm) == 22_713_728
    served = {"minilm": minilm, "embedder": folders["embedder"]}
    specs = [f"{name}={folder}" for name, folder in served.items()]
    settings = make_settings(minilm, model_id=specs, devices=["cpu"], dtype="float32")
    fits = settings.model_copy(update={"memory_budget_mb": 100})
    assert over_budget(fits, served) is None
    refusal = over_budget(settings.model_copy(update={"memory_budget_mb": 80}), served)
    assert refusal is not None
    assert "minilm: 87 MiB, embedder: 0 MiB" in refusal
    assert "more than memory_budget_mb 80" in refusal
    halved = settings.model_copy(update={"memory_budget_mb": 80, "dtype": "bfloat16"})
    assert over_budget(halved, served) is None
    # Compiled on two engines: each engine's prepacked copy, the checkpoint's (shared), and
    # inductor's layout in each of the four graphs of each engine (one input and batches, on
    # one thread and on both): 11 copies.
    compiled = settings.model_copy(
        update={"memory_budget_mb": 900, "compile": True, "devices": ["cpu", "cpu"]}
    )
    refusal = over_budget(compiled, served)
    assert refusal is not None and "minilm: 953 MiB" in refusal
    # A compiled int8 model's graphs share its plain int8 layers, which the engines share
    # too: one copy, 32 MiB. Served eagerly, each engine packs its own for fbgemm: 2 x 32 MiB.
    int8 = compiled.model_copy(update={"memory_budget_mb": 40, "dtype": "int8"})
    assert over_budget(int8, served) is None
    refusal = over_budget(int8.model_copy(update={"memory_budget_mb": 30}), served)
    assert refusal is not None and "minilm: 32 MiB" in refusal
    eager_int8 = int8.model_copy(update={"compile": False, "prepack": False})
    refusal = over_budget(eager_int8, served)
    assert refusal is not None and "minilm: 65 MiB" in refusal


def test_a_server_over_its_memory_budget_refuses_to_start(folders: dict[str, Path]) -> None:
    """The real command line: the refusal names each model's share, before any model loads
    or the port opens."""
    minilm = resolve_model_dir("sentence-transformers/all-MiniLM-L6-v2")
    started = subprocess.run(
        [
            sys.executable, "-m", "app", "--model-id", f"minilm={minilm}",
            "--model-id", f"embedder={folders['embedder']}", "--dtype", "float32",
            "--devices", "cpu", "--memory-budget-mb", "80",
            "--host", "127.0.0.1", "--port", str(free_port()),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert started.returncode == 1, started.stderr
    assert "minilm: 87 MiB, embedder: 0 MiB" in started.stderr
    assert "more than memory_budget_mb 80" in started.stderr
    assert "ready" not in started.stderr


async def test_with_one_model_the_model_field_is_not_checked(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (_, client):
        response = await client.post(
            "/v1/embeddings", json={"input": "a", "model": "text-embedding-3-small"}
        )
    assert response.status_code == 200


async def test_the_api_key_guards_every_model_and_their_names(folders: dict[str, Path]) -> None:
    key = {"Authorization": "Bearer secret"}
    async with running_app(several(folders, api_key="secret")) as (_, client):
        refused = [
            await client.post("/models/reranker/rerank", json={"query": "a", "texts": ["b"]}),
            await client.post("/", json={"inputs": "a"}),
            await client.post("/models/splade/", json={"inputs": "a"}),
            await client.get("/models/reranker/info"),
            await client.post("/models/nope/embed", json={"inputs": "a"}),
        ]
        unknown = await client.post("/models/nope/embed", json={"inputs": "a"}, headers=key)
        served = await client.post("/models/splade/", json={"inputs": "a"}, headers=key)
        probe = await client.get("/models/splade/health")
    assert [response.status_code for response in refused] == [401] * 5
    assert "embedder" not in refused[-1].text
    assert unknown.status_code == 404 and "/models/embedder/" in unknown.text
    assert served.status_code == 200
    assert set(served.json()[0][0]) == {"index", "value"}  # SPLADE's main route, /embed_sparse
    assert probe.status_code == 200


async def test_readiness_and_the_drain_cover_every_model(folders: dict[str, Path]) -> None:
    async with running_app(several(folders)) as (app, client):
        models = app.state.models
        models["splade"].warmed_up = False  # as while it loads
        waiting = await client.get("/health")
        assert waiting.status_code == 503
        assert "model splade: the model is loading" in waiting.json()["error"]
        assert (await client.get("/models/embedder/health")).status_code == 200
        models["splade"].warmed_up = True
        gate = GatedForward(models["reranker"])
        gate.gate.clear()
        held = asyncio.create_task(
            client.post("/models/reranker/rerank", json={"query": "a", "texts": ["b"]})
        )
        await asyncio.to_thread(gate.entered.wait, 10)
        models.begin_drain()
        refused = await client.post("/models/splade/embed_sparse", json={"inputs": "a"})
        assert not await models.wait_idle(0.05)  # the reranker's request is still running
        gate.gate.set()
        assert await models.wait_idle(10)
        assert (await held).status_code == 200
    assert refused.status_code == 503


async def test_a_models_file_gives_each_model_its_own_settings(
    placement: Placement, folders: dict[str, Path], tmp_path: Path
) -> None:
    models_file = tmp_path / "models.json"
    entries = [
        {"name": "embedder", "model_id": str(folders["embedder"]), "dtype": "bfloat16"},
        {"name": "reranker", "model_id": str(folders["reranker"]), "max_inputs_per_request": 2},
    ]
    models_file.write_text(json.dumps(entries))
    settings = Settings(models_file=models_file, devices=["cpu"], dtype="float32", threads=1)
    assert [served.name for served in settings.models()] == ["embedder", "reranker"]
    async with running_app(settings, placement) as (_, client):
        embedder = (await client.get("/models/embedder/info")).json()
        reranker = (await client.get("/models/reranker/info")).json()
        three = {"query": "a", "texts": ["b", "c", "d"]}
        refused = await client.post("/models/reranker/rerank", json=three)
        accepted = await client.post("/models/embedder/embed", json={"inputs": ["b", "c", "d"]})
    assert (embedder["dtype"], reranker["dtype"]) == ("bfloat16", "float32")
    assert reranker["limits"]["max_inputs_per_request"] == 2
    assert embedder["limits"]["max_inputs_per_request"] == 2048
    assert refused.status_code == 413 and "limit of 2" in refused.json()["error"]
    assert accepted.status_code == 200


def test_a_models_file_refuses_what_a_model_cannot_set(tmp_path: Path) -> None:
    models_file = tmp_path / "models.json"
    models_file.write_text(json.dumps([{"model_id": "/a", "port": 9000}]))
    with pytest.raises(ValueError, match="port cannot be set per model"):
        Settings(models_file=models_file)
    models_file.write_text(json.dumps([{"model_id": "/a", "max_queue_wait": 0}]))
    with pytest.raises(ValueError, match="model /a: max_queue_wait"):
        Settings(models_file=models_file)
    with pytest.raises(ValueError, match="not both"):
        Settings(models_file=models_file, model_id="/b")


def test_two_models_of_one_name_are_refused_with_how_to_name_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as flags:
        Settings(model_id=["a=/x", "a=/y"])
    assert "two models have one name: ['a', 'a']; name them apart with name=folder" in str(
        flags.value
    )
    models_file = tmp_path / "models.json"
    models_file.write_text(json.dumps([{"name": "a", "model_id": "/x"}, {"model_id": "a"}]))
    with pytest.raises(ValueError) as listed:
        Settings(models_file=models_file)
    assert "one name: ['a', 'a']; name them apart by their \"name\"" in str(listed.value)
    assert [m.name for m in Settings(model_id=["a=/x", "b=/x"]).models()] == ["a", "b"]
