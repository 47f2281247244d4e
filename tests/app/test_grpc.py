"""text-embeddings-inference's gRPC API (tei.v1): a plain grpcio client with the generated stubs
calls every rpc and gets what the HTTP routes answer on the same server; streams carry many
messages in order; bad input, a wrong model, overload and a missing key are gRPC statuses with
the routes' messages; a client that cancels leaves no work behind; reflection lists the
services. The real server process (--grpc-port) serves haystack's embedders, in both
placements, with two front ends sharing the port.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import transformers
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from app.grpc import tei_pb2 as pb
from app.grpc import tei_pb2_grpc as stubs
from app.grpc.server import GrpcServer
from app.grpc.service import TeiServicer
from model.heads import Splade
from tests.app.conftest import (
    GatedForward,
    local_engine,
    make_settings,
    running_app,
    service_of,
    wait_until,
)
from tests.app.test_server_process import ServerProcess, free_port
from tests.helpers import TINY_VOCAB, make_random_checkpoint
from tests.task_checkpoints import labelled, save_task_model, write_splade_folder

pytestmark = pytest.mark.anyio
TEXTS = ["the quick brown fox", "hello world", "a lazy dog jumps", "the cat"]
LONG = "the quick brown fox " * 40  # past the tiny model's limit
QUERY = "the quick fox"
TOLERANCE = 1e-6
Code = grpc.StatusCode


@dataclass
class Served:
    app: FastAPI
    http: httpx.AsyncClient
    channel: grpc.aio.Channel
    server: GrpcServer


@asynccontextmanager
async def serving(folder: Path, **overrides: Any) -> AsyncIterator[Served]:
    """The app with its lifespan, its HTTP client, and a gRPC server on the same service with
    a channel to it: one event loop, no process."""
    settings = make_settings(folder, host="127.0.0.1", grpc_port=free_port(), **overrides)
    async with running_app(settings) as (app, client):
        server = GrpcServer(settings, lambda: service_of(app), app.state.metrics)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield Served(app, client, channel, server)
        finally:
            await channel.close()
            await server.stop()


async def status_of(call: Any) -> tuple[Code, str]:
    """The status a call ends with, awaited (unary) or read to its end (stream)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    return caught.value.code(), caught.value.details() or ""


async def http_error(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    response = await client.post(path, json=body)
    assert response.status_code >= 400, response.text
    message: str = response.json()["error"]
    return message


def stub(service: str, channel: grpc.aio.Channel | grpc.Channel) -> Any:
    """The generated client stub of a tei.v1 service (the generated stubs are untyped)."""
    return getattr(stubs, f"{service}Stub")(channel)


def close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, atol=TOLERANCE)


@pytest.fixture
def reranker(tmp_path: Path) -> Path:
    folder = tmp_path / "reranker"
    save_task_model(folder, transformers.BertForSequenceClassification, "bert", num_labels=1)
    return folder


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    folder = tmp_path / "classifier"
    save_task_model(folder, transformers.BertForSequenceClassification, "bert", **labelled(3))
    return folder


@pytest.fixture
def splade(tmp_path: Path) -> Path:
    folder = tmp_path / "splade"
    save_task_model(folder, transformers.BertForMaskedLM, "bert")
    write_splade_folder(folder, Splade())
    return folder


# An embedding model ------------------------------------------------------------------------
async def test_embedding_calls_equal_their_routes(tiny_checkpoint: Path) -> None:
    async with serving(tiny_checkpoint) as served:
        http = served.http
        embed = stub("Embed", served.channel)
        tokenize = stub("Tokenize", served.channel)

        info = await stub("Info", served.channel).Info(pb.InfoRequest())
        want_info = (await http.get("/info")).json()
        assert info.model_id == want_info["model_id"]
        assert info.model_type == pb.MODEL_TYPE_EMBEDDING
        assert info.max_input_length == want_info["max_input_length"]
        assert info.max_client_batch_size == want_info["max_client_batch_size"]
        assert info.version == want_info["version"]

        call = embed.Embed(pb.EmbedRequest(inputs=TEXTS[0]))
        got = await call
        want = (await http.post("/embed", json={"inputs": TEXTS[0]})).json()
        close(got.embeddings, want[0])
        headers = dict(await call.trailing_metadata())  # with the status, not ahead of it
        assert int(headers["x-compute-tokens"]) == got.metadata.compute_tokens > 0
        assert got.metadata.compute_chars == len(TEXTS[0])
        assert got.metadata.total_time_ns >= got.metadata.inference_time_ns > 0

        # The optional fields, left out or set, as the route's defaults and its values.
        got = await embed.Embed(
            pb.EmbedRequest(
                inputs=LONG,
                truncate=True,
                normalize=False,
                dimensions=8,
                truncation_direction=pb.TRUNCATION_DIRECTION_LEFT,
            )
        )
        body = {
            "inputs": LONG,
            "truncate": True,
            "normalize": False,
            "dimensions": 8,
            "truncation_direction": "left",
        }
        close(got.embeddings, (await http.post("/embed", json=body)).json()[0])
        assert len(got.embeddings) == 8

        got_all = await embed.EmbedAll(pb.EmbedAllRequest(inputs=TEXTS[1]))
        want_all = (await http.post("/embed_all", json={"inputs": TEXTS[1]})).json()[0]
        close([row.embeddings for row in got_all.token_embeddings], want_all)

        for special in (True, False):
            tokens = await tokenize.Tokenize(
                pb.EncodeRequest(inputs=TEXTS[2], add_special_tokens=special)
            )
            body = {"inputs": TEXTS[2], "add_special_tokens": special}
            want_tokens = (await http.post("/tokenize", json=body)).json()[0]
            assert [
                {
                    "id": t.id,
                    "text": t.text,
                    "special": t.special,
                    "start": t.start if t.HasField("start") else None,
                    "stop": t.stop if t.HasField("stop") else None,
                }
                for t in tokens.tokens
            ] == want_tokens
        ids = [token.id for token in tokens.tokens]
        for skip in (True, False):
            text = await tokenize.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=skip))
            body = {"ids": ids, "skip_special_tokens": skip}
            assert [text.text] == (await http.post("/decode", json=body)).json()


async def test_streams_answer_many_messages_in_order(tiny_checkpoint: Path) -> None:
    texts = [f"{word} {number}" for number in range(60) for word in ("fox", "dog")]
    async with serving(tiny_checkpoint) as served:
        embed = stub("Embed", served.channel)
        tokenize = stub("Tokenize", served.channel)
        want = (await served.http.post("/embed", json={"inputs": texts})).json()
        got = [
            response.embeddings
            async for response in embed.EmbedStream(pb.EmbedRequest(inputs=t) for t in texts)
        ]
        assert len(got) == len(texts)
        close(got, want)

        want_all = (await served.http.post("/embed_all", json={"inputs": texts[:10]})).json()
        got_all = embed.EmbedAllStream(pb.EmbedAllRequest(inputs=t) for t in texts[:10])
        async for response, rows in zip_async(got_all, want_all):
            close([row.embeddings for row in response.token_embeddings], rows)

        want_tokens = (await served.http.post("/tokenize", json={"inputs": texts})).json()
        tokenized = tokenize.TokenizeStream(
            pb.EncodeRequest(inputs=t, add_special_tokens=True) for t in texts
        )
        ids = []
        async for response, tokens in zip_async(tokenized, want_tokens):
            assert [t.id for t in response.tokens] == [t["id"] for t in tokens]
            ids.append([t.id for t in response.tokens])
        decoded = tokenize.DecodeStream(
            pb.DecodeRequest(ids=i, skip_special_tokens=True) for i in ids
        )
        body = {"ids": ids, "skip_special_tokens": True}
        want_texts = (await served.http.post("/decode", json=body)).json()
        assert [response.text async for response in decoded] == want_texts


async def zip_async(call: Any, wants: list[Any]) -> AsyncIterator[tuple[Any, Any]]:
    """A stream's answers with what each should be; all of them, and no more."""
    count = 0
    async for response in call:
        yield response, wants[count]
        count += 1
    assert count == len(wants)


# Cross-encoders and SPLADE ----------------------------------------------------------------
async def test_reranker_calls_equal_their_routes(reranker: Path) -> None:
    async with serving(reranker) as served:
        http = served.http
        predict = stub("Predict", served.channel)
        rerank = stub("Rerank", served.channel)
        info = await stub("Info", served.channel).Info(pb.InfoRequest())
        assert info.model_type == pb.MODEL_TYPE_RERANKER

        got = await predict.Predict(pb.PredictRequest(inputs=QUERY, raw_scores=True))
        want = (await http.post("/predict", json={"inputs": QUERY, "raw_scores": True})).json()
        assert [p.label for p in got.predictions] == [w["label"] for w in want]
        assert [p.score for p in got.predictions] == pytest.approx([w["score"] for w in want])
        pair = [QUERY, TEXTS[0]]
        got = await predict.PredictPair(pb.PredictPairRequest(inputs=pair))
        want = (await http.post("/predict", json={"inputs": pair})).json()
        assert [p.score for p in got.predictions] == pytest.approx([w["score"] for w in want])

        pairs = [[QUERY, text] for text in TEXTS] * 5
        want_batch = (await http.post("/predict", json={"inputs": pairs})).json()
        got_pairs = predict.PredictPairStream(pb.PredictPairRequest(inputs=p) for p in pairs)
        async for response, scores in zip_async(got_pairs, want_batch):
            assert response.predictions[0].score == pytest.approx(scores[0]["score"], abs=1e-6)
        want_batch = (await http.post("/predict", json={"inputs": [[t] for t in TEXTS]})).json()
        got_texts = predict.PredictStream(pb.PredictRequest(inputs=t) for t in TEXTS)
        async for response, scores in zip_async(got_texts, want_batch):
            assert response.predictions[0].score == pytest.approx(scores[0]["score"], abs=1e-6)

        body = {"query": QUERY, "texts": TEXTS, "return_text": True}
        want = (await http.post("/rerank", json=body)).json()
        got = await rerank.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS, return_text=True))
        assert [(r.index, r.text) for r in got.ranks] == [(w["index"], w["text"]) for w in want]
        assert [r.score for r in got.ranks] == pytest.approx([w["score"] for w in want])
        assert got.metadata.compute_tokens > 0
        streamed = await rerank.RerankStream(
            pb.RerankStreamRequest(query=QUERY, text=text, return_text=True) for text in TEXTS
        )
        assert streamed.ranks == got.ranks

        # Without return_text, no text: the field is left out, as the route leaves it null.
        plain = await rerank.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS))
        assert not any(rank.HasField("text") for rank in plain.ranks)


async def test_classifier_predicts_and_refuses_to_rerank(classifier: Path) -> None:
    async with serving(classifier) as served:
        info = await stub("Info", served.channel).Info(pb.InfoRequest())
        assert info.model_type == pb.MODEL_TYPE_CLASSIFIER
        got = await stub("Predict", served.channel).Predict(pb.PredictRequest(inputs=QUERY))
        want = (await served.http.post("/predict", json={"inputs": QUERY})).json()
        assert [p.label for p in got.predictions] == [w["label"] for w in want]
        assert [p.score for p in got.predictions] == pytest.approx([w["score"] for w in want])
        rerank = stub("Rerank", served.channel)
        message = await http_error(served.http, "/rerank", {"query": QUERY, "texts": TEXTS})
        assert "use /predict" in message
        call = rerank.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS))
        assert await status_of(call) == (Code.FAILED_PRECONDITION, message)
        streamed = rerank.RerankStream(iter([pb.RerankStreamRequest(query=QUERY, text="a")]))
        assert await status_of(streamed) == (Code.FAILED_PRECONDITION, message)


async def test_sparse_calls_equal_their_route(splade: Path) -> None:
    async with serving(splade) as served:
        embed = stub("Embed", served.channel)
        want = (await served.http.post("/embed_sparse", json={"inputs": TEXTS})).json()
        got = await embed.EmbedSparse(pb.EmbedSparseRequest(inputs=TEXTS[0]))
        assert [value.index for value in got.sparse_embeddings] == [w["index"] for w in want[0]]
        assert [value.value for value in got.sparse_embeddings] == pytest.approx(
            [w["value"] for w in want[0]]
        )
        streamed = embed.EmbedSparseStream(pb.EmbedSparseRequest(inputs=t) for t in TEXTS)
        async for response, values in zip_async(streamed, want):
            assert [v.index for v in response.sparse_embeddings] == [w["index"] for w in values]


async def test_a_call_of_another_task_is_the_routes_424(tiny_checkpoint: Path) -> None:
    async with serving(tiny_checkpoint) as served:
        calls: list[tuple[Any, Any, str, dict[str, Any]]] = [
            (stub("Predict", served.channel).Predict, pb.PredictRequest(inputs="a"),
             "/predict", {"inputs": "a"}),
            (stub("Embed", served.channel).EmbedSparse, pb.EmbedSparseRequest(inputs="a"),
             "/embed_sparse", {"inputs": "a"}),
            (stub("Rerank", served.channel).Rerank, pb.RerankRequest(query="a", texts=["b"]),
             "/rerank", {"query": "a", "texts": ["b"]}),
        ]  # fmt: skip
        for stub_call, request, path, body in calls:
            message = await http_error(served.http, path, body)
            assert await status_of(stub_call(request)) == (Code.FAILED_PRECONDITION, message)


# Bad input, limits and keys ---------------------------------------------------------------
async def test_bad_input_is_a_status_with_the_routes_message(tiny_checkpoint: Path) -> None:
    async with serving(tiny_checkpoint, max_input_chars=500) as served:
        http = served.http
        embed = stub("Embed", served.channel)
        tokenize = stub("Tokenize", served.channel)
        cases: list[tuple[Any, str | None, Any]] = [
            (embed.Embed(pb.EmbedRequest(inputs="")), "/embed", {"inputs": ""}),
            (
                embed.Embed(pb.EmbedRequest(inputs="a", dimensions=0)),
                "/embed",
                {"inputs": "a", "dimensions": 0},
            ),
            (
                embed.Embed(pb.EmbedRequest(inputs="a", dimensions=999)),
                "/embed",
                {"inputs": "a", "dimensions": 999},
            ),
            (
                embed.Embed(pb.EmbedRequest(inputs=LONG)),  # truncate: false, as proto3 says
                "/embed",
                {"inputs": LONG, "truncate": False},
            ),
            (embed.Embed(pb.EmbedRequest(inputs="a" * 501)), "/embed", {"inputs": "a" * 501}),
            (
                embed.Embed(pb.EmbedRequest(inputs="a", prompt_name="nope")),
                "/embed",
                {"inputs": "a", "prompt_name": "nope"},
            ),
            (tokenize.Decode(pb.DecodeRequest(ids=[])), "/decode", {"ids": []}),
            (tokenize.Decode(pb.DecodeRequest(ids=[10**6])), "/decode", {"ids": [10**6]}),
            (
                stub("Predict", served.channel).PredictPair(
                    pb.PredictPairRequest(inputs=["a", "b", "c"])
                ),
                None,
                "inputs: a pair holds one or two texts, got 3",
            ),
        ]  # fmt: skip
        for call, path, body in cases:
            message = body if path is None else await http_error(http, path, body)
            assert await status_of(call) == (Code.INVALID_ARGUMENT, message), path
        direction = pb.EmbedRequest(inputs="a", truncation_direction=7)  # type: ignore[arg-type]
        code, message = await status_of(embed.Embed(direction))
        assert code == Code.INVALID_ARGUMENT and "truncation_direction" in message

        # Bytes that are no EmbedRequest (a string field that is not UTF-8): INVALID_ARGUMENT.
        raw: Any = served.channel.unary_unary("/tei.v1.Embed/Embed")
        code, message = await status_of(raw(b"\x0a\x02\xff\xfe"))
        assert code == Code.INVALID_ARGUMENT and "cannot be parsed" in message

        # A stream answers its good messages, then ends at the bad one.
        requests = [pb.EmbedRequest(inputs=t) for t in ("one", "two", "", "four")]
        stream = embed.EmbedStream(iter(requests))
        answered = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for response in stream:
                answered.append(response)
        assert len(answered) == 2 and caught.value.code() == Code.INVALID_ARGUMENT

        # Unknown calls are grpc's own UNIMPLEMENTED; the server still answers.
        unknown: Any = served.channel.unary_unary("/tei.v1.Embed/Nope")
        assert (await status_of(unknown(b"")))[0] == Code.UNIMPLEMENTED
        assert len((await embed.Embed(pb.EmbedRequest(inputs="still here"))).embeddings) == 32


async def test_a_full_server_and_a_missing_key(tiny_checkpoint: Path) -> None:
    async with serving(
        tiny_checkpoint, max_batch_inputs=1, max_concurrent_requests=1, api_key="sesame"
    ) as served:
        embed = stub("Embed", served.channel)
        key = (("authorization", "Bearer sesame"),)
        message = await http_error(served.http, "/embed", {"inputs": "a"})
        code, details = await status_of(embed.Embed(pb.EmbedRequest(inputs="a")))
        assert code == Code.UNAUTHENTICATED and details.startswith(message.split(" (")[0])
        wrong = (("authorization", "Bearer open"),)
        assert (await status_of(embed.Embed(pb.EmbedRequest(inputs="a"), metadata=wrong)))[
            0
        ] == Code.UNAUTHENTICATED
        info = stub("Info", served.channel).Info
        assert (await status_of(info(pb.InfoRequest())))[0] == Code.UNAUTHENTICATED
        # Counted as requests, as the HTTP routes count a 401.
        counted = (await served.http.get("/metrics")).text
        assert 'embed_requests_total{route="/tei.v1.Embed/Embed",status="401"} 2.0' in counted
        assert (await info(pb.InfoRequest(), metadata=key)).model_id

        gate = GatedForward(service_of(served.app))
        gate.gate.clear()
        held = embed.Embed(pb.EmbedRequest(inputs="held"), metadata=key)
        await asyncio.to_thread(gate.entered.wait, 10)
        # One call in progress is the limit: the next is refused at once, with Retry-After.
        call = embed.Embed(pb.EmbedRequest(inputs="more"), metadata=key)
        assert (await status_of(call))[0] == Code.RESOURCE_EXHAUSTED
        assert ("retry-after", "1") in tuple(await call.trailing_metadata())
        gate.gate.set()
        assert len((await held).embeddings) == 32


async def test_the_engines_429_and_504(tiny_checkpoint: Path) -> None:
    """As test_batching's 429: 1 s of work at 0.01 s per token is 100 tokens queued."""
    async with serving(tiny_checkpoint, max_batch_inputs=1, request_timeout=1.0) as served:
        embed = stub("Embed", served.channel)
        batcher = local_engine(served.app).model.batcher
        assert batcher is not None
        gate = GatedForward(service_of(served.app))
        held = await gate.hold(served.http)  # "hello", 3 tokens
        batcher._seconds, batcher._tokens = 0.01, 1.0
        queued = [embed.Embed(pb.EmbedRequest(inputs=f"fox {i}")) for i in range(24)]
        await wait_until(lambda: batcher.depth == 24)
        message = await http_error(served.http, "/embed", {"inputs": "fox 9"})
        call = embed.Embed(pb.EmbedRequest(inputs="fox 9"))
        assert await status_of(call) == (Code.RESOURCE_EXHAUSTED, message)
        assert "retry-after" in dict(await call.trailing_metadata())
        batcher._seconds = 0.0
        gate.gate.set()
        assert (await held).status_code == 200
        assert [len((await q).embeddings) for q in queued] == [32] * len(queued)

    async with serving(tiny_checkpoint, request_timeout=0.3) as served:
        gate = GatedForward(service_of(served.app))
        gate.gate.clear()
        call = stub("Embed", served.channel).Embed(pb.EmbedRequest(inputs="held"))
        status = await status_of(call)
        gate.gate.set()
    assert status == (Code.DEADLINE_EXCEEDED, "no result within the request timeout of 0.3 s")


async def test_not_ready_is_unavailable(tiny_checkpoint: Path) -> None:
    from app.main import create_app

    settings = make_settings(tiny_checkpoint, host="127.0.0.1", grpc_port=free_port())
    app = create_app(settings)  # its lifespan never runs: the model is not loaded
    server = GrpcServer(settings, lambda: service_of(app), app.state.metrics)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = stub("Embed", channel).Embed(pb.EmbedRequest(inputs="a"))
            assert await status_of(call) == (Code.UNAVAILABLE, "the model is loading")
            info = stub("Info", channel).Info(pb.InfoRequest())
            assert await status_of(info) == (Code.UNAVAILABLE, "the model is loading")
    finally:
        await server.stop()


# Cancelling, draining, reflection ---------------------------------------------------------
async def test_a_cancelled_stream_leaves_no_work_behind(tiny_checkpoint: Path) -> None:
    async with serving(tiny_checkpoint, max_batch_inputs=1) as served:
        service = service_of(served.app)
        gate = GatedForward(service)
        held = await gate.hold(served.http)
        batcher = local_engine(served.app).model.batcher
        assert batcher is not None
        embed = stub("Embed", served.channel)
        call = embed.EmbedStream(pb.EmbedRequest(inputs="fox") for _ in range(20))
        await wait_until(lambda: batcher.depth == 20)
        call.cancel()
        await wait_until(lambda: service.inflight == 1)  # the held /embed alone
        gate.gate.set()
        assert (await held).status_code == 200
        await wait_until(lambda: batcher.idle)  # the worker dropped the abandoned inputs
        after = ["hello world", "a lazy dog"]
        got = [r async for r in embed.EmbedStream(pb.EmbedRequest(inputs=t) for t in after)]
        assert len(got) == len(after)
    fox = TINY_VOCAB.index("fox")
    assert not any(fox in ids for batch in gate.batches for ids in batch)
    assert service.inflight == 0


async def test_drain_ends_idle_streams_and_finishes_calls_in_flight(
    tiny_checkpoint: Path,
) -> None:
    async with serving(tiny_checkpoint) as served:
        service = service_of(served.app)
        embed = stub("Embed", served.channel)
        idle = embed.EmbedStream()
        await idle.write(pb.EmbedRequest(inputs="first"))
        assert len((await idle.read()).embeddings) == 32  # then the client sends nothing more
        gate = GatedForward(service)
        gate.gate.clear()
        in_flight = embed.Embed(pb.EmbedRequest(inputs="in flight"))
        await asyncio.to_thread(gate.entered.wait, 10)

        service.begin_drain()
        draining = asyncio.ensure_future(served.server.drain(10))
        assert await idle.code() == Code.UNAVAILABLE
        assert await idle.details() == "the server is shutting down"
        gate.gate.set()
        assert len((await in_flight).embeddings) == 32
        await asyncio.wait_for(draining, 10)
        code, _ = await status_of(embed.Embed(pb.EmbedRequest(inputs="too late")))
        assert code == Code.UNAVAILABLE


async def test_reflection_lists_the_services(tiny_checkpoint: Path) -> None:
    async with serving(tiny_checkpoint) as served:
        channel: Any = served.channel  # typed for the synchronous API; the same calls
        reflect: Any = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest
        answers = [
            answer
            async for answer in reflect.ServerReflectionInfo(
                iter([ask(list_services=""), ask(file_containing_symbol="tei.v1.Embed")])
            )
        ]
        names = {service.name for service in answers[0].list_services_response.service}
        assert {f"tei.v1.{s}" for s in ("Info", "Embed", "Predict", "Rerank", "Tokenize")} <= names
        assert "grpc.health.v1.Health" in names
        assert answers[1].file_descriptor_response.file_descriptor_proto


async def test_a_taken_port_fails_start_up_clearly(tiny_checkpoint: Path) -> None:
    """A server alone binds its port exclusively: it never joins another on SO_REUSEPORT."""
    async with serving(tiny_checkpoint) as served:
        settings = served.server.settings
        again = GrpcServer(settings, lambda: service_of(served.app), served.app.state.metrics)
        with pytest.raises(
            OSError, match=f"cannot listen for gRPC on 127.0.0.1:{served.server.port}"
        ):
            await again.start()


def test_a_missing_generated_module_names_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.grpc

    monkeypatch.setitem(sys.modules, "app.grpc.tei_pb2", None)
    monkeypatch.delattr(app.grpc, "tei_pb2")
    monkeypatch.delitem(sys.modules, "app.grpc.protocol")
    with pytest.raises(ImportError, match=r"python -m app\.grpc\.generate"):
        importlib.import_module("app.grpc.protocol")


# The real server process: haystack, both placements, two front ends on one port ----------
@dataclass
class GrpcProcess:
    process: ServerProcess
    target: str
    frontends: int


@pytest.fixture(scope="module", params=["in-process", "split"])
def grpc_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[GrpcProcess]:
    folder = tmp_path_factory.mktemp("grpc")
    make_random_checkpoint(folder / "tiny")
    port = free_port()
    flags = ["--model-id", str(folder / "tiny"), "--grpc-port", str(port), "--dtype", "float32"]
    frontends = 2 if request.param == "split" else 1
    if request.param == "split":
        flags += ["--placement", "split", "--frontends", str(frontends)]
    process = ServerProcess(folder, *flags, threads="1")
    try:
        process.wait_ready(frontends=frontends)
        yield GrpcProcess(process, f"127.0.0.1:{port}", frontends)
    finally:
        process.stop()


@pytest.mark.slow
def test_haystack_embedders_get_the_vectors_of_embed(
    grpc_server: GrpcProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAYSTACK_TELEMETRY_ENABLED", "False")  # no phoning home from a test
    from haystack import Document
    from haystack_integrations.components.embedders.huggingface_api import (
        HuggingFaceAPIDocumentEmbedder,
        HuggingFaceAPITextEmbedder,
    )

    texts = [*TEXTS, "Größe 東京 🚀"]
    url = f"{grpc_server.process.url}/embed"

    def embed(**options: bool) -> np.ndarray:
        response = httpx.post(url, json={"inputs": texts, **options}, timeout=60)
        return np.array(response.json(), dtype=np.float32)

    params = {"url": grpc_server.target}
    # haystack's defaults: truncate, and no normalisation.
    text_embedder = HuggingFaceAPITextEmbedder(
        api_type="text_embeddings_inference", api_params=params, use_grpc=True
    )
    text_embedder.warm_up()
    raw = embed(truncate=True, normalize=False)
    close(text_embedder.run(text=texts[-1])["embedding"], raw[-1])
    documents = HuggingFaceAPIDocumentEmbedder(
        api_type="text_embeddings_inference",
        api_params=params,
        use_grpc=True,
        batch_size=2,
        normalize=True,
    )
    documents.warm_up()
    embedded = documents.run(documents=[Document(content=text) for text in texts])["documents"]
    close([document.embedding for document in embedded], embed())
    text_embedder.close()
    documents.close()


@pytest.mark.slow
def test_many_channels_then_a_clean_drain(grpc_server: GrpcProcess) -> None:
    """Each channel is a connection, spread over the front ends that share the port."""
    response = httpx.post(f"{grpc_server.process.url}/embed", json={"inputs": TEXTS}, timeout=60)
    want = np.array(response.json(), dtype=np.float32)
    for _ in range(8):
        with grpc.insecure_channel(grpc_server.target) as channel:
            embed = stub("Embed", channel)
            close([embed.Embed(pb.EmbedRequest(inputs=t)).embeddings for t in TEXTS], want)
            streamed = embed.EmbedStream(iter([pb.EmbedRequest(inputs=t) for t in TEXTS]))
            close([r.embeddings for r in streamed], want)
    grpc_server.process.process.send_signal(signal.SIGTERM)
    assert grpc_server.process.process.wait(timeout=60) == 0
    log = grpc_server.process.log.read_text()
    assert "Traceback" not in log
    # Every front end listened on the one port.
    assert log.count(f"gRPC (tei.v1) on {grpc_server.target}") == grpc_server.frontends


async def test_a_stream_still_sending_holds_no_slot(reranker: Path) -> None:
    """A RerankStream is read before it takes one of the calls in progress: with one allowed,
    a client still sending its pairs leaves room for another call."""
    async with serving(reranker, max_concurrent_requests=1) as served:
        rerank = stub("Rerank", served.channel)
        sending: asyncio.Queue[pb.RerankStreamRequest | None] = asyncio.Queue()

        async def pairs() -> AsyncIterator[pb.RerankStreamRequest]:
            while (message := await sending.get()) is not None:
                yield message

        streamed = rerank.RerankStream(pairs())
        await sending.put(pb.RerankStreamRequest(query=QUERY, text=TEXTS[0]))
        await asyncio.sleep(0.2)  # read by the server, which waits for more
        alone = await rerank.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS))
        assert len(alone.ranks) == len(TEXTS)
        await sending.put(None)
        assert [rank.index for rank in (await streamed).ranks] == [0]


async def test_the_health_service_says_what_health_says(tiny_checkpoint: Path) -> None:
    """grpc.health.v1's Check, for Kubernetes' grpc probes and Envoy: SERVING while /health
    is 200, with no API key, for the server ("") or a tei.v1 service; NOT_FOUND for another
    name; NOT_SERVING once a stop has come."""
    async with serving(tiny_checkpoint, api_key="sesame") as served:
        check = health_pb2_grpc.HealthStub(served.channel).Check
        serving_status = health_pb2.HealthCheckResponse.SERVING
        assert (await check(health_pb2.HealthCheckRequest())).status == serving_status
        named = health_pb2.HealthCheckRequest(service="tei.v1.Embed")
        assert (await check(named)).status == serving_status
        unknown = check(health_pb2.HealthCheckRequest(service="nope"))
        assert (await status_of(unknown))[0] == Code.NOT_FOUND
        service_of(served.app).begin_stop()
        assert (await served.http.get("/health")).status_code == 503
        stopping = await check(health_pb2.HealthCheckRequest())
        assert stopping.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_an_unexpected_error_is_internal_with_an_id_unique_to_the_process(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As HTTP's 500: the id names the process's start (front ends share the port), and the
    log holds it with the traceback."""

    async def broken(self: TeiServicer, request: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(TeiServicer, "embed", broken)
    async with serving(tiny_checkpoint) as served:
        call = stub("Embed", served.channel).Embed(pb.EmbedRequest(inputs="a"))
        code, details = await status_of(call)
    assert code == Code.INTERNAL
    found = re.fullmatch(r"internal error \(request id ([0-9a-f]{12}-\d+)\)", details)
    assert found is not None and f"request id {found[1]}" in caplog.text
    assert "injected" not in details
