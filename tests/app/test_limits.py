"""Every limit, at the limit (accepted) and one past it (refused with its documented status).

The tiny model's tokenizer makes counts exact: "hello" is [CLS] hello [SEP], 3 tokens, and
"hello world" 4. The connection bound needs the real server: tests/app/test_slow_clients.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest

from app.engine.batcher import Batcher
from app.errors import OverloadedError
from app.middleware import BodyDeadline
from app.tokenization import INLINE_CHARS, TOKENIZER_THREADS
from model import Embedder
from tests.app.conftest import (
    GatedForward,
    local_engine,
    make_settings,
    running_app,
    service_of,
    wait_until,
)
from tests.app.test_batching import make_batcher, make_ticket

pytestmark = pytest.mark.anyio
HIDDEN = 32  # the tiny model's hidden size
HEADERS = {"content-type": "application/json"}


def padded_body(size: int) -> bytes:
    """A valid /embed body of exactly `size` bytes: one input of "a"s."""
    frame = b'{"inputs": ""}'
    return frame[:-2] + b"a" * (size - len(frame)) + frame[-2:]


async def trickle(body: bytes, pieces: int, pause: float) -> AsyncIterator[bytes]:
    """The body in `pieces` chunks, `pause` seconds apart (a chunked, slow upload)."""
    step = math.ceil(len(body) / pieces)
    for start in range(0, len(body), step):
        await asyncio.sleep(pause)
        yield body[start : start + step]


async def test_payload_limit(tiny_checkpoint: Path) -> None:
    limit = 4096
    async with running_app(make_settings(tiny_checkpoint, payload_limit=limit)) as (_, client):
        at = await client.post("/embed", content=padded_body(limit), headers=HEADERS)
        past = await client.post("/embed", content=padded_body(limit + 1), headers=HEADERS)
        # Without a Content-Length (chunked) the bound holds as the body arrives.
        streamed = await client.post(
            "/embed", content=trickle(padded_body(limit + 1), 4, 0), headers=HEADERS
        )
        streamed_at = await client.post(
            "/embed", content=trickle(padded_body(limit), 4, 0), headers=HEADERS
        )
    assert at.status_code == 200 and streamed_at.status_code == 200
    assert past.status_code == 413 and streamed.status_code == 413
    assert past.json() == {
        "error": f"the body is over the payload limit of {limit} bytes",
        "error_type": "PayloadTooLarge",
    }


async def test_inputs_per_request(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint, max_inputs_per_request=5)
    async with running_app(settings) as (_, client):
        at = await client.post("/embed", json={"inputs": ["hello"] * 5})
        past = await client.post("/embed", json={"inputs": ["hello"] * 6})
        past_openai = await client.post("/v1/embeddings", json={"input": ["hello"] * 6})
    assert at.status_code == 200 and len(at.json()) == 5
    assert past.status_code == 413
    assert past.json()["error"] == "the request holds 6 inputs, more than the limit of 5"
    assert past_openai.status_code == 413
    assert past_openai.json()["error"]["code"] == "payloadtoolarge"


async def test_characters_per_input(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint, max_input_chars=1000)) as (_, client):
        at = await client.post("/embed", json={"inputs": ["hello", "x" * 1000]})
        past = await client.post("/embed", json={"inputs": ["hello", "x" * 1001]})
        # Characters, not bytes: 1000 four-byte characters are within the limit.
        wide = await client.post("/embed", json={"inputs": "\U0001f600" * 1000})
    assert at.status_code == 200 and wide.status_code == 200
    assert past.status_code == 413
    assert past.json()["error"] == "input 1 has 1001 characters, more than the limit of 1000"


async def test_tokens_per_request(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint, max_request_tokens=30)) as (_, client):
        at = await client.post("/embed", json={"inputs": ["hello"] * 10})  # 10 x 3 tokens
        past = await client.post("/embed", json={"inputs": ["hello world"] + ["hello"] * 9})
        # Counted after truncation: 2 x 48 tokens of text cut to the model's limit is 96.
        cut = await client.post("/embed", json={"inputs": ["hello " * 200] * 2})
    assert at.status_code == 200
    assert past.status_code == 413
    assert past.json()["error"].startswith("the request holds 31 tokens, more than the limit of 30")
    assert cut.status_code == 413 and "96 tokens" in cut.json()["error"]


@pytest.mark.parametrize("path", ["/embed_all", "/encode"])
async def test_per_token_values(tiny_checkpoint: Path, path: str) -> None:
    limit = 6 * HIDDEN  # two inputs of "hello": 6 tokens of 32 values
    extra: dict[str, Any] = {"token_embeddings": True} if path == "/encode" else {}
    async with running_app(make_settings(tiny_checkpoint, max_token_values=limit)) as (_, client):
        at = await client.post(path, json={"inputs": ["hello", "hello"], **extra})
        past = await client.post(path, json={"inputs": ["hello", "hello world"], **extra})
        # Pooled vectors alone are not per-token values.
        pooled = await client.post("/encode", json={"inputs": ["hello world"] * 3})
    assert at.status_code == 200
    assert past.status_code == 422
    assert f"hold {7 * HIDDEN} values" in past.json()["error"]
    assert f"over the limit of {limit}" in past.json()["error"]
    assert pooled.status_code == 200


async def test_attention_values_per_request(tiny_checkpoint: Path) -> None:
    """One layer, one head: a 3-token input asks for 3 x 3 = 9 values."""
    attention = {"layers": [0], "heads": [0]}
    settings = make_settings(tiny_checkpoint, max_attention_values=18)
    async with running_app(settings) as (_, client):
        at = await client.post("/encode", json={"inputs": ["hello"] * 2, "attention": attention})
        past = await client.post("/encode", json={"inputs": ["hello"] * 3, "attention": attention})
        # A mean over heads returns one map per layer, but computes every head it averages:
        # over the tiny model's 4 heads, one 3-token input takes 4 x 9 values.
        mean_of_all = {"layers": [0], "reduce": "mean"}
        all_heads = await client.post("/encode", json={"inputs": "hello", "attention": mean_of_all})
        mean_of_one = {"layers": [0], "heads": [0], "reduce": "mean"}
        one_head = await client.post(
            "/encode", json={"inputs": ["hello"] * 2, "attention": mean_of_one}
        )
    assert at.status_code == 200
    assert past.status_code == 422
    assert "take 27 values" in past.json()["error"] and "limit of 18" in past.json()["error"]
    assert all_heads.status_code == 422
    assert "take 36 values" in all_heads.json()["error"]
    assert one_head.status_code == 200


async def test_attention_values_per_batch(tiny_checkpoint: Path) -> None:
    """Each request is within the limit; a batch computes every asked head of every input at
    the padded width, so at most two 3-token inputs of one map run together."""
    attention = {"layers": [0], "heads": [0]}
    settings = make_settings(tiny_checkpoint, max_attention_values=18)
    async with running_app(settings) as (app, client):
        service = service_of(app)
        gate = GatedForward(service)
        gate.gate.clear()
        first = asyncio.create_task(
            client.post("/encode", json={"inputs": "hello", "attention": attention})
        )
        await asyncio.to_thread(gate.entered.wait, 10)
        queued = [
            asyncio.create_task(
                client.post("/encode", json={"inputs": "hello", "attention": attention})
            )
            for _ in range(3)
        ]
        batcher = local_engine(service).model.batcher
        assert batcher is not None
        await wait_until(lambda: batcher.depth == 3)
        gate.gate.set()
        responses = await asyncio.gather(first, *queued)
    assert [r.status_code for r in responses] == [200] * 4
    # The held one alone, then two at the limit (18 values), then the one past it.
    assert [len(batch) for batch in gate.batches] == [1, 2, 1]


def paced_batcher(embedder: Embedder, **bounds: float) -> Batcher:
    """A batcher whose estimate is 1/64 s a token (exact in binary)."""
    batcher = make_batcher(embedder, **bounds)
    batcher._seconds, batcher._tokens = 1 / 64, 1.0
    return batcher


def test_queue_bound(tiny_embedder: Embedder) -> None:
    """At 1/64 s a token and a 1 s bound, the queue holds 64 tokens of work; the 65th is
    refused with a Retry-After from the estimate."""
    batcher = paced_batcher(tiny_embedder, max_wait=1.0)
    batcher.submit(make_ticket(40))
    batcher.submit(make_ticket(24))  # 64 tokens: 1.0 s of work, at the bound
    with pytest.raises(OverloadedError) as refused:
        batcher.submit(make_ticket(1))
    assert refused.value.retry_after == 1
    assert batcher.depth == 2
    # Twice the bound ahead: retry once the excess has drained.
    with pytest.raises(OverloadedError) as far:
        batcher.submit(make_ticket(128))
    assert far.value.retry_after == 2  # (64 + 128) / 64 s = 3 s, 2 s past the bound


def test_the_work_ahead_of_a_request_is_bounded_by_max_queue_wait(tiny_embedder: Embedder) -> None:
    """Under overload, accepted requests wait at most max_queue_wait behind others, so the
    backlog clears that fast once the load drops; a request's own work does not count."""
    batcher = paced_batcher(tiny_embedder, max_wait=30.0, max_queue_wait=1.0)
    batcher.submit(make_ticket(64))  # 1.0 s ahead of the next one: at the bound
    batcher.submit(make_ticket(640))  # its own 10 s are within its 30 s
    with pytest.raises(OverloadedError) as refused:
        batcher.submit(make_ticket(1))
    assert "11.0 s of work, more than the 1 s" in refused.value.message
    assert refused.value.retry_after == 10
    with pytest.raises(OverloadedError):
        batcher.check_room(30.0)  # refused before tokenizing too
    assert batcher.depth == 2


def test_the_queue_bound_counts_the_time_a_request_has_left(tiny_embedder: Embedder) -> None:
    """A request that spent part of its time (on its body, on the tokenizer) is admitted
    only if the work ahead fits in what is left; a full queue refuses before tokenizing."""
    batcher = paced_batcher(tiny_embedder, max_wait=1.0)
    batcher.submit(make_ticket(31))
    batcher.submit(make_ticket(1), within=0.5)  # 32 tokens: 0.5 s, at what is left
    with pytest.raises(OverloadedError) as refused:
        batcher.submit(make_ticket(1), within=0.5)  # 33 tokens: past it
    assert "0.5 s left" in refused.value.message and refused.value.retry_after == 1
    batcher.submit(make_ticket(32))  # with its whole second: 64 tokens, at the bound
    with pytest.raises(OverloadedError):
        batcher.submit(make_ticket(1), within=5.0)  # never past max_wait
    batcher.check_room(1.0)  # the queue alone is at the bound, not past it
    with pytest.raises(OverloadedError):
        batcher.check_room(0.9)  # 1 s of work ahead, 0.9 s left: refused untokenized


def test_inputs_nobody_waits_for_do_not_fill_the_queue(tiny_embedder: Embedder) -> None:
    """Found by bench/soak.py: clients that left while queued made the queue look full, and a
    client that stayed got 429 for work that would never run."""
    batcher = paced_batcher(tiny_embedder, max_wait=1.0)
    gone = make_ticket(64)
    batcher.submit(gone)  # a whole second of work
    gone.abandoned = True  # its client disconnected
    batcher.check_room(0.5)
    batcher.submit(make_ticket(64))
    assert batcher.depth == 1  # only the request that stayed: its 64 tokens, a second of work


async def test_queue_bound_over_http(tiny_checkpoint: Path) -> None:
    """The same bound through the routes: at 30/64 s a token, 64 tokens fill the 30 s; one
    token more than 63 does not fit in what is left of a request's 30 s."""
    settings = make_settings(
        tiny_checkpoint, request_timeout=30.0, max_queue_wait=30.0, max_batch_inputs=1
    )
    async with running_app(settings) as (app, client):
        service = service_of(app)
        batcher = local_engine(service).model.batcher
        assert batcher is not None
        gate = GatedForward(service)
        held = await gate.hold(client)  # 3 tokens running
        batcher._seconds, batcher._tokens = 30 / 64, 1.0
        # 3 running + 30 + 30 queued = 63 tokens: 29.5 s, within the time the request has
        # left (its 30 s, less the milliseconds it took to get here).
        at = asyncio.create_task(client.post("/embed", json={"inputs": [[5] * 30, [5] * 30]}))
        await wait_until(lambda: batcher.depth == 2)
        past = await client.post("/embed", json={"inputs": [[5]]})
        batcher._seconds = 0.0  # let the held work finish at once
        gate.gate.set()
        accepted = await asyncio.gather(held, at)
    assert [r.status_code for r in accepted] == [200, 200]
    assert past.status_code == 429 and past.headers["retry-after"] == "1"
    assert past.json()["error_type"] == "Overloaded"


async def test_request_timeout(tiny_checkpoint: Path) -> None:
    """Results within the timeout are answered; past it, a 504 (never a 503, which a load
    balancer would retry elsewhere although the work may have run)."""
    settings = make_settings(tiny_checkpoint, request_timeout=3.0, max_batch_inputs=1)
    async with running_app(settings) as (app, client):
        gate = GatedForward(service_of(app))
        within = await gate.hold(client)
        gate.gate.set()  # released well within the 3 s
        answered = await within
        gate.gate.clear()
        gate.entered.clear()
        late = asyncio.create_task(client.post("/embed", json={"inputs": "world"}))
        await asyncio.to_thread(gate.entered.wait, 10)
        timed_out = await late  # held until past the timeout
        gate.gate.set()
    assert answered.status_code == 200
    assert timed_out.status_code == 504
    assert timed_out.json() == {
        "error": "no result within the request timeout of 3.0 s",
        "error_type": "Timeout",
    }


async def test_body_timeout(tiny_checkpoint: Path) -> None:
    body = json.dumps({"inputs": "hello world"}).encode()
    settings = make_settings(tiny_checkpoint, body_timeout=1.0)
    async with running_app(settings) as (_, client):
        # 4 pieces 0.05 s apart: in well within the second.
        within = await client.post("/embed", content=trickle(body, 4, 0.05), headers=HEADERS)
        # 4 pieces 0.5 s apart: the last would arrive after 2 s.
        slow = await client.post("/embed", content=trickle(body, 4, 0.5), headers=HEADERS)
    assert within.status_code == 200
    assert slow.status_code == 408
    assert slow.json() == {
        "error": "the body did not arrive within the body timeout of 1 s",
        "error_type": "BodyTimeout",
    }


async def test_a_body_deadline_ends_only_its_own_wait() -> None:
    """Past its time the read stops and says so; a cancellation from elsewhere (a shutdown)
    still cancels, even one in the same instant; a read that finished in time is never
    cancelled later; and the task's count of cancellations comes back as it was."""

    class AlsoCancelledThen(BodyDeadline):
        __slots__ = ()

        def _expire(self) -> None:
            super()._expire()
            self._task.cancel()  # someone else, at the same moment

    async def read(
        seconds: float, wait: float, swallow: bool = False, kind: type[BodyDeadline] = BodyDeadline
    ) -> bool:
        with kind(seconds) as deadline:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                if not swallow:
                    raise
        await asyncio.sleep(0.1)  # past the deadline: its timer must be gone
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        return deadline.expired

    def task_of(reading: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        """A task of its own: the deadline cancels the task it is made in."""
        return asyncio.ensure_future(reading)

    assert await task_of(read(0.05, 10)) is True
    assert await task_of(read(0.05, 0)) is False
    # The block took the cancellation and went on: no 408, and nothing left pending.
    assert await task_of(read(0.05, 10, swallow=True)) is False
    outside = task_of(read(10, 10))
    await asyncio.sleep(0.05)
    outside.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outside
    with pytest.raises(asyncio.CancelledError):
        await task_of(read(0.05, 10, kind=AlsoCancelledThen))

    async def cancelled_before() -> bool:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # taken, its count left at 1
            await asyncio.sleep(1)
        with BodyDeadline(0.05) as deadline:
            await asyncio.sleep(10)
        return deadline.expired

    assert await task_of(cancelled_before()) is True


async def test_a_request_whose_time_went_on_tokenizing_is_not_queued(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its deadline once tokenized: a 504 at once, and its inputs are never queued
    (nobody waits for them)."""
    settings = make_settings(tiny_checkpoint, request_timeout=0.5)
    async with running_app(settings) as (app, client):
        service = service_of(app)
        tokenize = service.tokenization.run

        async def slow_tokenize(*args: Any, **kwargs: Any) -> Any:
            done = await tokenize(*args, **kwargs)
            await asyncio.sleep(0.6)
            return done

        monkeypatch.setattr(service.tokenization, "run", slow_tokenize)
        assert local_engine(service).model.batcher is not None
        submitted: list[object] = []
        monkeypatch.setattr(
            local_engine(service).model.batcher, "submit", lambda *args: submitted.append(args)
        )
        late = await client.post("/embed", json={"inputs": "hello"})
    assert late.status_code == 504
    assert late.json()["error"] == "no result within the request timeout of 0.5 s"
    assert submitted == []


async def test_a_request_waiting_for_the_tokenizer_pool_gets_its_504_in_time(
    tiny_checkpoint: Path,
) -> None:
    """Large requests are tokenized in a pool; one stuck behind others there is answered at
    its deadline, not when the pool gets to it."""
    settings = make_settings(tiny_checkpoint, request_timeout=0.5)
    async with running_app(settings) as (app, client):
        service = service_of(app)
        release = threading.Event()
        for _ in range(TOKENIZER_THREADS):  # the pool busy with earlier work
            service.tokenization._pool.submit(release.wait, 30)
        started = time.perf_counter()
        late = await client.post("/embed", json={"inputs": "word " * (INLINE_CHARS // 5 + 1)})
        waited = time.perf_counter() - started
        release.set()
    assert late.status_code == 504
    assert late.json()["error"] == "no result within the request timeout of 0.5 s"
    assert waited < 5
