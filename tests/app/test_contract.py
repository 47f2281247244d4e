"""The published contract, proven by schemathesis (pinned in pyproject's dev extra).

schemathesis's engine (what `schemathesis run` drives) runs against the app's own
/openapi.json in-process over ASGI, with every check it has, through its coverage phase
(boundary values of every field, wrong types, unsupported methods) and its fuzzing phase, on
every operation: no 5xx, every response matches its documented schema, status code, content
type and headers, every schema-valid request is accepted, every schema-violating one refused.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import schemathesis
import transformers
from fastapi import FastAPI
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema
from schemathesis.hooks import HookContext
from schemathesis.python import asgi

from app.main import create_app
from app.schemas import BOUND
from model import InputError
from model.heads import Splade
from tests.app.conftest import (
    engine_process,
    make_settings,
    running_app,
    service_of,
    wait_until,
)
from tests.helpers import TINY_CONFIG, TINY_VOCAB, make_random_checkpoint
from tests.task_checkpoints import save_task_model, write_splade_folder

# Small limits, so that the coverage phase's longest strings and fullest lists stay cheap.
LIMITS = {"max_inputs_per_request": 16, "max_input_chars": 1000}
API_KEY = "contract-key"
# Examples per operation and generation mode in the fuzzing phase; the coverage phase adds
# its own boundary cases.
MAX_EXAMPLES = 25
# schemathesis's defaults, plus 413: the service refuses too many inputs or too many
# characters (over maxItems and maxLength) as too large, which is a refusal too; and 424: a
# route the loaded model does not serve (/rerank on an embedding model) refuses everything,
# valid or not. Each kind of model is run, so every route is also seen serving.
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "424"]
REJECTIONS += ["428", "429", "5xx"]  # 5xx: schemathesis's default; not_a_server_error fails it
ACCEPTANCES = ["2xx", "3xx", "401", "403", "404", "409", "424", "429", "5xx"]
# Fields whose strings and id lists are texts the model reads.
TEXT_FIELDS = {"inputs", "input", "query", "texts", "source_sentence", "sentences"}
OPERATIONS_SERVED_BY_ANY_MODEL = {
    "GET /info",
    "GET /health",
    "GET /live",
    "GET /ping",
    "GET /metrics",
    "GET /v1/models",
    "POST /tokenize",
    "POST /decode",
    "POST /embed_all",
    "POST /encode",
}
SERVED = {
    "embedding": OPERATIONS_SERVED_BY_ANY_MODEL
    | {
        "POST /embed",
        "POST /embed_chunks",
        "POST /v1/embeddings",
        "POST /v2/embed",
        "POST /similarity",
    },
    "reranker": OPERATIONS_SERVED_BY_ANY_MODEL | {"POST /predict", "POST /rerank"},
    "splade": OPERATIONS_SERVED_BY_ANY_MODEL | {"POST /embed_sparse"},
}


@dataclass
class Outcome:
    failures: list[str] = field(default_factory=list)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    phases: set[str] = field(default_factory=set)

    def operations_with(self, status: int) -> set[str]:
        return {label for label, code in self.statuses if code == status}


def start(app: FastAPI) -> None:
    """Start the app's lifespan in schemathesis's ASGI runner and wait for the model."""
    with asgi.get_client(cast(Any, app)):
        deadline = time.monotonic() + 60
        while not service_of(app).ready:
            assert time.monotonic() < deadline, "the app never became ready"
            time.sleep(0.02)


def checkpoint_of(kind: str, folder: Path) -> Path:
    if kind == "embedding":
        make_random_checkpoint(folder)
    elif kind == "reranker":
        save_task_model(folder, transformers.BertForSequenceClassification, "bert", num_labels=1)
    else:
        save_task_model(folder, transformers.BertForMaskedLM, "bert")
        write_splade_folder(folder, Splade())
    return folder


@pytest.fixture(scope="module")
def stop_lifespans() -> Iterator[None]:
    yield
    asgi.shutdown_lifespans()


def texts_in(value: Any) -> Iterator[str | list[int]]:
    """The texts and id lists in a body's text fields, however nested."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(v, int | float) for v in value)
    ):
        yield value if isinstance(value, str) else [int(v) for v in value]
    elif isinstance(value, list):
        for item in value:
            yield from texts_in(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key in TEXT_FIELDS:
                yield from texts_in(item)


def run_schemathesis(app: FastAPI, *, headers: dict[str, str] | None = None) -> Outcome:
    config = SchemathesisConfig.from_dict(
        {
            "headers": headers or {},
            "generation": {"max-examples": MAX_EXAMPLES},
            "checks": {
                "negative_data_rejection": {"expected-statuses": REJECTIONS},
                "positive_data_acceptance": {"expected-statuses": ACCEPTANCES},
            },
        }
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    codec = service_of(app).codec
    assert codec is not None
    limit = codec.info.max_input_tokens

    def fits(body: dict[str, Any]) -> bool:
        """Whether the texts together (a pair's template adds up to 3 special tokens) are
        within the model's token limit: a sum over all of them, so it errs towards false."""
        total = 3
        for text in texts_in(body):
            try:
                [encoded] = codec.tokenize([text], truncate=False, add_special_tokens=False)
            except InputError:
                return False
            total += len(encoded.ids)
        return total <= limit

    def chunks_what_it_cannot(body: dict[str, Any]) -> bool:
        """Chunking with an overlap not below the chunk size, of token ids, or on /encode
        with more than the pooled vector asked for."""
        chunking = body.get("chunking")
        if not isinstance(chunking, dict):
            return False
        # `attention: {}` asks for maps too (every layer and head): present, not truthy.
        wants_more = body.get("token_embeddings") or body.get("attention") is not None
        if wants_more or body.get("pooled") is False:
            return True
        if any(not isinstance(item, str) for item in texts_in(body.get("inputs"))):
            return True  # token ids: chunks are located by characters
        if not chunking.get("overlap"):
            return False
        size = chunking.get("size")
        return not isinstance(size, int) or chunking["overlap"] >= size

    def filter_case(context: HookContext, case: schemathesis.Case[Any]) -> bool:
        """The rules JSON Schema cannot state: with `truncate: false`, text over the model's
        token limit is refused, and so is chunking with an overlap not below the chunk size,
        of token ids, or with per-token vectors or attention maps (422s, documented; an
        overlap without a size is left out, the default size being the model's). Such cases
        are not sent as valid."""
        body = case.body
        if case.meta is None or not case.meta.generation.mode.is_positive:
            return True
        if not isinstance(body, dict):
            return True
        if chunks_what_it_cannot(body):
            return False
        parameters = body.get("parameters")
        options = parameters if isinstance(parameters, dict) else body
        return options.get("truncate") is not False or fits(body)

    schema.hook(filter_case)
    outcome = Outcome()
    for event in from_schema(schema).execute():
        if isinstance(event, events.PhaseFinished):
            outcome.phases.add(event.phase.name.value)
        elif isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            recorder = event.recorder
            for interaction in recorder.interactions.values():
                if interaction.response is not None:
                    outcome.statuses[recorder.label, interaction.response.status_code] += 1
            for checks in recorder.checks.values():
                for check in checks:
                    if check.failure_info is not None:
                        failure = check.failure_info.failure
                        outcome.failures.append(
                            f"{recorder.label} {check.name}: {failure.title}\n{failure.message}\n"
                            f"{check.failure_info.code_sample}"
                        )
        elif isinstance(event, events.NonFatalError | events.FatalError):
            outcome.failures.append(f"engine error: {event}")
        elif isinstance(event, events.EngineFinished):
            outcome.failures.extend(str(failure) for failure in event.failures)
    return outcome


@pytest.mark.parametrize(
    ("kind", "api_key", "placement"),
    [
        ("embedding", None, "in-process"),
        ("embedding", API_KEY, "in-process"),
        ("reranker", None, "in-process"),
        ("splade", None, "in-process"),
        ("embedding", None, "split"),
    ],
    ids=["embedding", "embedding-with-api-key", "reranker", "splade", "embedding-split"],
)
def test_the_service_keeps_its_published_contract(
    tmp_path: Path, stop_lifespans: None, kind: str, api_key: str | None, placement: str
) -> None:
    settings = make_settings(checkpoint_of(kind, tmp_path / kind), api_key=api_key, **LIMITS)
    with ExitStack() as stack:
        engine = stack.enter_context(engine_process(settings)) if placement == "split" else None
        app = create_app(settings, engine)
        start(app)
        check_the_contract(app, kind, api_key)


def check_the_contract(app: FastAPI, kind: str, api_key: str | None) -> None:
    operations = {
        f"{method.upper()} {path}"
        for path, methods in app.openapi()["paths"].items()
        for method in methods
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    outcome = run_schemathesis(app, headers=headers)
    assert not outcome.failures, "\n\n".join(outcome.failures[:10])
    assert {"coverage", "fuzzing"} <= outcome.phases
    assert {label for label, _ in outcome.statuses} == operations  # every route was called
    # Valid requests were accepted where the model serves the route, and refused with 424
    # where it does not (on /encode, pooled vectors need an embedding model).
    assert outcome.operations_with(200) == SERVED[kind]
    unserved = operations - SERVED[kind]
    assert unserved <= outcome.operations_with(424) <= unserved | {"POST /encode"}
    # Each way of refusing a body was exercised where bodies are read (on a model that is
    # not an embedding model, /encode answers most requests 424 before any limit).
    posted = {operation for operation in SERVED[kind] if operation.startswith("POST")}
    partly = set() if kind == "embedding" else {"POST /encode"}
    for status in (400, 413, 415, 422):
        assert outcome.operations_with(status) >= posted - {"POST /decode"} - partly, status
    protected = {
        f"{method.upper()} {path}"
        for path, methods in app.openapi()["paths"].items()
        for method, operation in methods.items()
        if "security" in operation
    }
    if api_key:  # ignored_auth sent requests without the key, and wrong ones: all refused
        assert protected and outcome.operations_with(401) == protected
    else:
        assert not protected and not outcome.operations_with(401)
    assert not any(code >= 500 for _, code in outcome.statuses)


@pytest.mark.anyio
async def test_the_schema_states_the_loaded_models_bounds(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint, **LIMITS)) as (_, client):
        schema = (await client.get("/openapi.json")).json()
    requests = schema["components"]["schemas"]
    embed = requests["EmbedRequest"]["properties"]
    text, ids, many = embed["inputs"]["anyOf"]
    assert text["maxLength"] == LIMITS["max_input_chars"]
    assert ids["items"]["maximum"] == len(TINY_VOCAB) - 1
    assert many["maxItems"] == LIMITS["max_inputs_per_request"]
    assert embed["dimensions"]["anyOf"][0]["maximum"] == 32
    assert embed["prompt_name"]["anyOf"][0]["enum"] == [""]  # the tiny model has no prompts
    attention = requests["AttentionRequest"]["properties"]
    layers, heads = TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_attention_heads"]
    assert attention["layers"]["anyOf"][0]["items"] == {
        "type": "integer",
        "minimum": -layers,
        "maximum": layers - 1,
    }
    assert attention["heads"]["anyOf"][0]["items"]["maximum"] == heads - 1
    # /decode: id lists count as inputs, and no list holds more ids than a request's tokens.
    one, lists = requests["DecodeRequest"]["properties"]["ids"]["anyOf"]
    assert lists["maxItems"] == LIMITS["max_inputs_per_request"]
    assert one["maxItems"] == lists["items"]["maxItems"] == 300_000  # max_request_tokens
    assert BOUND not in str(schema)  # every marker was replaced by its bound


@pytest.mark.anyio
async def test_the_schema_names_the_bounds_before_the_model_loads(tiny_checkpoint: Path) -> None:
    app = create_app(make_settings(tiny_checkpoint))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        early = (await client.get("/openapi.json")).json()
        async with app.router.lifespan_context(app):
            await wait_until(lambda: service_of(app).ready)
            loaded = (await client.get("/openapi.json")).json()
    ids = early["components"]["schemas"]["EmbedRequest"]["properties"]["inputs"]["anyOf"][1]
    assert ids["items"][BOUND] == "token_id" and "maximum" not in ids["items"]
    ids = loaded["components"]["schemas"]["EmbedRequest"]["properties"]["inputs"]["anyOf"][1]
    assert ids["items"]["maximum"] == len(TINY_VOCAB) - 1
