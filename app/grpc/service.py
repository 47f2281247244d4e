"""The tei.v1 calls, each one request of its HTTP route through the same service layer.

A message becomes the route's own request model (app/schemas.py), validated as the route
validates its JSON body, so that a gRPC call and its route take the same inputs, answer the
same values and refuse with the same messages; then the same `EmbeddingService` call, with its
limits and its batching. One function per unary call: a streaming call runs its unary
counterpart once per message (app/grpc/server.py), and RerankStream ranks all its messages as
one /rerank. No gRPC here; errors are the service's own (app/errors.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from google.protobuf.message import Message
from pydantic import BaseModel, ValidationError

from app.errors import (
    EmptyInputError,
    PayloadTooLargeError,
    ValidationFailedError,
    WrongTaskError,
)
from app.grpc.protocol import pb
from app.params import EncodeOptions, TextPair
from app.parsing import validation_error
from app.responses import OFF_LOOP_VALUES, timing_headers
from app.routes.ops import package_version
from app.schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    EmbedSparseRequest,
    PredictRequest,
    RerankRequest,
    TokenizeRequest,
)
from app.service import EmbeddingService, EncodeResult
from app.tasks import TASKS, require_task
from app.tasks.classifier import is_reranker, probabilities
from app.tokenization import TOKENIZER_THREADS
from model.vectors import FloatArray

Response = TypeVar("Response", bound=Message)
Body = TypeVar("Body", bound=BaseModel)
DIRECTIONS: dict[int, str] = {
    pb.TRUNCATION_DIRECTION_RIGHT: "right",
    pb.TRUNCATION_DIRECTION_LEFT: "left",
}
# tei.v1's model types, by the key of /info's model_type (app/tasks/).
MODEL_TYPES: dict[str, pb.ModelType] = {
    "embedding": pb.MODEL_TYPE_EMBEDDING,
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "reranker": pb.MODEL_TYPE_RERANKER,
}


class Truncating(Protocol):
    """The fields of every message whose texts are embedded or scored."""

    @property
    def truncate(self) -> bool: ...

    @property
    def truncation_direction(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Reply(Generic[Response]):
    """A call's answer, and the HTTP route's x-compute-* headers as response metadata."""

    message: Response
    headers: Mapping[str, str] = field(default_factory=dict)


# A unary call's work: its request message to its reply.
Answer = Callable[[Any], Awaitable[Reply[Any]]]


def parse(model: type[Body], fields: dict[str, Any]) -> Body:
    """The message's fields as the route's request model, or the route's error."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def truncation(request: Truncating) -> dict[str, Any]:
    """`truncate` and `truncation_direction`, which every embedding and predicting message has:
    proto3's false and RIGHT when the client left them out, as text-embeddings-inference reads
    them."""
    direction = DIRECTIONS.get(request.truncation_direction)
    if direction is None:
        raise ValidationFailedError(
            f"truncation_direction: {request.truncation_direction} is not a direction "
            "(TRUNCATION_DIRECTION_RIGHT or TRUNCATION_DIRECTION_LEFT)",
            param="truncation_direction",
        )
    return {"truncate": request.truncate, "truncation_direction": direction}


def present(request: Message, *names: str) -> dict[str, Any]:
    """The `optional` fields the client set; those left out take the route's default."""
    return {name: getattr(request, name) for name in names if request.HasField(name)}


def metadata(result: EncodeResult) -> pb.Metadata:
    """What the request cost, in text-embeddings-inference's Metadata message."""
    timings = result.timings
    return pb.Metadata(
        compute_chars=result.char_count,
        compute_tokens=result.token_count,
        total_time_ns=int((time.perf_counter() - timings.started) * 1e9),
        tokenization_time_ns=int(timings.tokenization * 1e9),
        queue_time_ns=int(timings.queue * 1e9),
        inference_time_ns=int(timings.inference * 1e9),
    )


class TeiServicer:
    """The answers of the tei.v1 calls from the service `service()` returns (called once per
    request, so that whoever owns the services may swap them)."""

    def __init__(self, service: Callable[[], EmbeddingService]) -> None:
        self.service = service

    def answers(self) -> dict[str, Answer]:
        """The unary calls by their rpc names in tei.proto."""
        return {
            "Info": self.info,
            "Embed": self.embed,
            "EmbedSparse": self.embed_sparse,
            "EmbedAll": self.embed_all,
            "Predict": self.predict,
            "PredictPair": self.predict_pair,
            "Rerank": self.rerank,
            "Tokenize": self.tokenize,
            "Decode": self.decode,
        }

    async def info(self, request: pb.InfoRequest) -> Reply[pb.InfoResponse]:
        service = self.service()
        model = service.info
        settings = service.settings
        # The task's own description, as /info gives it: sparse models are embeddings there
        # too (tei.v1 has no other value for them).
        (described,) = TASKS[model.task].tei_model_type(model)
        kind = MODEL_TYPES[described]
        return Reply(
            pb.InfoResponse(
                version=package_version(),
                model_id=model.model_id,
                model_dtype=model.dtype,
                model_type=kind,
                max_concurrent_requests=settings.max_concurrent_requests,
                max_input_length=model.max_input_tokens,
                max_batch_tokens=settings.max_batch_tokens,
                max_batch_requests=settings.max_batch_inputs,
                max_client_batch_size=settings.max_inputs_per_request,
                tokenization_workers=TOKENIZER_THREADS,
            )
        )

    async def embed(self, request: pb.EmbedRequest) -> Reply[pb.EmbedResponse]:
        service = self.service()
        fields = {"inputs": request.inputs, **truncation(request)}
        body = parse(
            EmbedRequest, fields | present(request, "normalize", "prompt_name", "dimensions")
        )
        require_task(service.info, "/embed")
        result = await service.encode(body.inputs_list(), body.options())
        vector = result.vectors()[0]
        response = pb.EmbedResponse(embeddings=vector.tolist(), metadata=metadata(result))
        return Reply(response, timing_headers(result))

    async def embed_sparse(self, request: pb.EmbedSparseRequest) -> Reply[pb.EmbedSparseResponse]:
        service = self.service()
        fields = {"inputs": request.inputs, **truncation(request)}
        body = parse(EmbedSparseRequest, fields | present(request, "prompt_name"))
        require_task(service.info, "/embed_sparse")
        result = await service.encode(body.inputs_list(), body.options())
        ids, weights = result.items[0].sparse
        values = [
            pb.SparseValue(index=index, value=value)
            for index, value in zip(ids.tolist(), weights.tolist(), strict=True)
        ]
        response = pb.EmbedSparseResponse(sparse_embeddings=values, metadata=metadata(result))
        return Reply(response, timing_headers(result))

    async def embed_all(self, request: pb.EmbedAllRequest) -> Reply[pb.EmbedAllResponse]:
        service = self.service()
        fields = {"inputs": request.inputs, **truncation(request)}
        body = parse(EmbedAllRequest, fields | present(request, "prompt_name"))
        require_task(service.info, "/embed_all")
        result = await service.encode(body.inputs_list(), body.options())
        rows = result.items[0].token_embeddings
        assert rows is not None, "per-token embeddings were asked for"

        def build() -> pb.EmbedAllResponse:
            vectors = [pb.TokenEmbedding(embeddings=row) for row in rows.tolist()]
            return pb.EmbedAllResponse(token_embeddings=vectors, metadata=metadata(result))

        # As the route renders its JSON: a large answer is built off the event loop.
        large = rows.size > OFF_LOOP_VALUES
        response = await asyncio.to_thread(build) if large else build()
        return Reply(response, timing_headers(result))

    async def predict(self, request: pb.PredictRequest) -> Reply[pb.PredictResponse]:
        return await self._predict(request.inputs, request)

    async def predict_pair(self, request: pb.PredictPairRequest) -> Reply[pb.PredictResponse]:
        texts = list(request.inputs)
        if len(texts) > 2:
            raise ValidationFailedError(
                f"inputs: a pair holds one or two texts, got {len(texts)}", param="inputs"
            )
        return await self._predict(texts, request)

    async def _predict(
        self, inputs: str | list[str], request: pb.PredictRequest | pb.PredictPairRequest
    ) -> Reply[pb.PredictResponse]:
        """POST /predict of one text, or of a text pair [text, text]."""
        service = self.service()
        fields = {"inputs": inputs, "raw_scores": request.raw_scores, **truncation(request)}
        body = parse(PredictRequest, fields)
        require_task(service.info, "/predict")
        result = await service.encode(body.inputs_list(), body.options())
        scores = probabilities(result.items[0].vector, body.raw_scores)
        ranked = sorted(zip(scores.tolist(), result.model.labels, strict=True), reverse=True)
        predictions = [pb.Prediction(score=score, label=label) for score, label in ranked]
        response = pb.PredictResponse(predictions=predictions, metadata=metadata(result))
        return Reply(response, timing_headers(result))

    async def rerank(self, request: pb.RerankRequest) -> Reply[pb.RerankResponse]:
        fields = {
            "query": request.query,
            "texts": list(request.texts),
            "raw_scores": request.raw_scores,
            "return_text": request.return_text,
            **truncation(request),
        }
        body = parse(RerankRequest, fields)
        service = self._reranker()
        result = await service.encode(body.pairs(), body.options())
        scores = self._scores([result], body.raw_scores)
        texts = body.texts if body.return_text else None
        return Reply(self._ranks(scores, texts, [result]), timing_headers(result))

    async def rerank_stream(
        self, requests: AsyncIterator[pb.RerankStreamRequest]
    ) -> Reply[pb.RerankResponse]:
        """One (query, text) pair per message, ranked together once the client has sent
        them all; raw_scores and return_text are the first message's. Messages with other
        truncation options than the first are encoded in requests of their own."""
        service = self._reranker()
        limit = service.settings.max_inputs_per_request
        bodies: list[RerankRequest] = []
        first: dict[str, bool] = {}
        async for request in requests:
            if len(bodies) == limit:
                raise PayloadTooLargeError(
                    f"the stream holds more than {limit} pairs, the limit of inputs per request"
                )
            first = first or {"raw_scores": request.raw_scores, "return_text": request.return_text}
            fields = {"query": request.query, "texts": [request.text], **truncation(request)}
            bodies.append(parse(RerankRequest, fields | first))
        if not bodies:
            raise EmptyInputError("the stream held no message")
        groups: dict[EncodeOptions, list[int]] = {}
        for index, body in enumerate(bodies):
            groups.setdefault(body.options(), []).append(index)
        results = []
        order: list[int] = []
        for options, indices in groups.items():
            pairs: list[str | list[int] | TextPair] = [bodies[i].pairs()[0] for i in indices]
            results.append(await service.encode(pairs, options))
            order.extend(indices)
        scores = np.empty(len(bodies), dtype=np.float32)
        scores[order] = self._scores(results, bodies[0].raw_scores)
        texts = [body.texts[0] for body in bodies] if bodies[0].return_text else None
        return Reply(self._ranks(scores, texts, results))

    def _reranker(self) -> EmbeddingService:
        """The service, if its model reranks; else the route's 424."""
        service = self.service()
        info = service.info
        require_task(info, "/rerank")
        if not is_reranker(info):
            raise WrongTaskError(
                f"this route needs a reranker (a classifier with one label); the loaded model "
                f"has {len(info.labels)} labels: use /predict"
            )
        return service

    @staticmethod
    def _scores(results: Sequence[EncodeResult], raw: bool) -> FloatArray:
        logits = np.array([item.vector[0] for result in results for item in result.items])
        return probabilities(logits[:, None], raw)[:, 0]

    @staticmethod
    def _ranks(
        scores: FloatArray, texts: Sequence[str] | None, results: Sequence[EncodeResult]
    ) -> pb.RerankResponse:
        """The ranks, highest score first (ties in input order), as /rerank gives them."""
        ranks = [
            pb.Rank(index=int(index), score=float(scores[index]))
            if texts is None
            else pb.Rank(index=int(index), score=float(scores[index]), text=texts[index])
            for index in np.argsort(-scores, kind="stable")
        ]
        return pb.RerankResponse(ranks=ranks, metadata=combined(results))

    async def tokenize(self, request: pb.EncodeRequest) -> Reply[pb.EncodeResponse]:
        service = self.service()
        fields = {"inputs": request.inputs, "add_special_tokens": request.add_special_tokens}
        body = parse(TokenizeRequest, fields | present(request, "prompt_name"))
        tokenized = await service.tokenize(
            body.inputs_list(), body.options(), add_special_tokens=body.add_special_tokens
        )
        [source], [item] = tokenized.texts, tokenized.encoded
        tokens = []
        for position, (token_id, token) in enumerate(zip(item.ids, item.tokens, strict=True)):
            special = item.special[position]
            if item.offsets and not special and isinstance(source, str):
                start, stop = item.offsets[position]
                tokens.append(
                    pb.SimpleToken(
                        id=token_id,
                        text=source[start:stop],
                        special=special,
                        start=start,
                        stop=stop,
                    )
                )
            else:
                tokens.append(pb.SimpleToken(id=token_id, text=token, special=special))
        return Reply(pb.EncodeResponse(tokens=tokens))

    async def decode(self, request: pb.DecodeRequest) -> Reply[pb.DecodeResponse]:
        service = self.service()
        fields = {"ids": list(request.ids), "skip_special_tokens": request.skip_special_tokens}
        body = parse(DecodeRequest, fields)
        [text] = await service.decode(body.ids_list(), skip_special_tokens=body.skip_special_tokens)
        return Reply(pb.DecodeResponse(text=text))


def combined(results: Sequence[EncodeResult]) -> pb.Metadata:
    """One Metadata for the requests of a call: counts summed, times from the first start and
    the longest of each step."""
    first = metadata(results[0])
    for result in results[1:]:
        more = metadata(result)
        first.compute_chars += more.compute_chars
        first.compute_tokens += more.compute_tokens
        first.tokenization_time_ns = max(first.tokenization_time_ns, more.tokenization_time_ns)
        first.queue_time_ns = max(first.queue_time_ns, more.queue_time_ns)
        first.inference_time_ns = max(first.inference_time_ns, more.inference_time_ns)
    return first
