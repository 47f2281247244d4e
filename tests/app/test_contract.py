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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from pydantic import TypeAdapter
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema
from schemathesis.hooks import HookContext
from schemathesis.python import asgi

from app.main import create_app
from app.schemas import BOUND, Inputs, as_list
from tests.app.conftest import make_settings, running_app, service_of, wait_until
from tests.helpers import TINY_CONFIG, TINY_VOCAB, make_random_checkpoint

# Small limits, so that the coverage phase's longest strings and fullest lists stay cheap.
LIMITS = {"max_inputs_per_request": 16, "max_input_chars": 1000}
API_KEY = "contract-key"
# Examples per operation and generation mode in the fuzzing phase; the coverage phase adds
# its own boundary cases. About 20 s a run on a loaded 2-core machine.
MAX_EXAMPLES = 40
# schemathesis's defaults, plus 413: the service refuses too many inputs or too many
# characters (over maxItems and maxLength) as too large, which is a refusal too.
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
REJECTIONS += ["5xx"]  # schemathesis's own default; not_a_server_error fails any 5xx anyway
INPUTS: TypeAdapter[Inputs] = TypeAdapter(Inputs)
INFERENCE = {
    "POST /embed",
    "POST /embed_all",
    "POST /tokenize",
    "POST /v1/embeddings",
    "POST /encode",
}
OPERATIONS = INFERENCE | {"GET /info", "GET /health", "GET /live", "GET /metrics"}


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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("contract") / "tiny"
    make_random_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def stop_lifespans() -> Iterator[None]:
    yield
    asgi.shutdown_lifespans()


def run_schemathesis(app: FastAPI, *, headers: dict[str, str] | None = None) -> Outcome:
    config = SchemathesisConfig.from_dict(
        {
            "headers": headers or {},
            "generation": {"max-examples": MAX_EXAMPLES},
            "checks": {"negative_data_rejection": {"expected-statuses": REJECTIONS}},
        }
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    embedder = service_of(app).embedder
    assert embedder is not None

    def filter_case(context: HookContext, case: schemathesis.Case[Any]) -> bool:
        """The one rule JSON Schema cannot state: with `truncate: false`, an input over the
        model's token limit is refused (422, documented). Such cases are not sent as valid."""
        body = case.body
        if case.meta is None or not case.meta.generation.mode.is_positive:
            return True
        if not isinstance(body, dict) or body.get("truncate") is not False:
            return True
        inputs = as_list(INPUTS.validate_python(body.get("inputs", body.get("input"))))
        encoded = embedder.tokenize(inputs, prompt_name=cast(str | None, body.get("prompt_name")))
        return not any(e.truncated for e in encoded)

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


@pytest.mark.parametrize("api_key", [None, API_KEY], ids=["open", "with-api-key"])
def test_the_service_keeps_its_published_contract(
    checkpoint: Path, stop_lifespans: None, api_key: str | None
) -> None:
    app = create_app(make_settings(checkpoint, api_key=api_key, **LIMITS))
    start(app)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    outcome = run_schemathesis(app, headers=headers)
    assert not outcome.failures, "\n\n".join(outcome.failures[:10])
    assert {"coverage", "fuzzing"} <= outcome.phases
    assert {label for label, _ in outcome.statuses} == OPERATIONS  # every route was called
    assert outcome.operations_with(200) == OPERATIONS  # and accepted valid requests
    for status in (400, 413, 415, 422):  # each way of refusing a body was exercised
        assert outcome.operations_with(status) >= INFERENCE
    if api_key:  # ignored_auth sent requests without the key, and wrong ones: all refused
        assert outcome.operations_with(401) == INFERENCE | {"GET /info"}
    else:
        assert not outcome.operations_with(401)
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
