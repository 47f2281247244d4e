"""A front end's own CPU per request, without HTTP and without a model in the way.

bench.serving_cost measures a whole server under wrk: uvicorn, the front end, the engine and
the forward passes together, on a machine whose speed drifts by a fifth between rounds. Here
one process runs the app itself (the middleware, the one body parser, the route, the
tokenizer, the response) for `POST /embed` of one short sentence, driven as ASGI by 32
concurrent callers, with an engine that answers every submission on the event loop's next
turn with a fixed vector: what is left is the front end's Python per request. Each round is
a fresh process pinned to a core; with --against REVISION that revision's app (from a
temporary git worktree) takes its turn in every round, and each keeps its best round.
Usage: python -m bench.frontend_cost [--seconds 4] [--rounds 4] [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvloop

from app.engine.batcher import Ticket
from app.engine.local import LocalEngine, LocalPending
from app.engine.protocol import ItemResult, Outcome, Wants
from app.main import create_app
from app.metrics import Metrics
from app.settings import Settings
from bench.serving_cost import make_tiny_model, pinning
from bench.side_by_side import checkout, turns
from bench.workload import short_sentences
from model import Encoded

RESULTS = Path(__file__).resolve().parent / "results" / "frontend_cost.json"
CALLERS = 32
WARM_UP_SECONDS = 1.5


@dataclass(frozen=True)
class Round:
    us_per_request: float  # of CPU, the whole process's
    requests: int


async def drive(model: Path, seconds: float) -> Round:
    """This process's app over `seconds` of requests, after a warm-up."""
    vector = np.random.default_rng(0).random(32, dtype=np.float32)

    class InstantEngine(LocalEngine):
        """The model loaded for real (its card, the warm-up); each submission then answered
        on the next turn of the loop, with a fixed vector per input."""

        def submit(self, encoded: Sequence[Encoded], wants: Wants, deadline: float) -> LocalPending:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[Outcome] = loop.create_future()
            items = [ItemResult(vector) for _ in encoded]
            loop.call_soon(future.set_result, Outcome(items, 0.0, 0.0))
            return LocalPending(future, Ticket(encoded, wants, deadline, future))

    assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    settings = Settings(model_id=str(model), devices=["cpu"], dtype="float32", threads=1)
    engine = InstantEngine(settings, settings.models()[0], Metrics())
    app = create_app(settings, engine)
    bodies = [orjson.dumps({"inputs": text}) for text in short_sentences(500, seed=3)]

    async def one(body: bytes) -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        # What the app reads of a POST /embed's scope (the fast path, app/dispatch.py).
        scope = {"type": "http", "method": "POST", "path": "/embed", "headers": headers}
        await app(scope, receive, send)
        if status != [200]:
            raise SystemExit(f"POST /embed answered {status}")

    async def callers(seconds: float) -> int:
        """Requests made by CALLERS concurrent callers for `seconds`."""
        until = time.perf_counter() + seconds
        done = 0

        async def caller(first: int) -> None:
            nonlocal done
            for index in itertools.count(first, CALLERS):
                if time.perf_counter() >= until:
                    return
                await one(bodies[index % len(bodies)])
                done += 1

        await asyncio.gather(*(caller(k) for k in range(CALLERS)))
        return done

    async with app.router.lifespan_context(app):
        await callers(WARM_UP_SECONDS)
        started = time.process_time()
        requests = await callers(seconds)
        return Round((time.process_time() - started) / requests * 1e6, requests)


def child(model: Path, seconds: float) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the server sets it
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    print(json.dumps(asdict(asyncio.run(drive(model, seconds)))))


def run_round(source: Path, pin: list[str], model: Path, seconds: float) -> Round:
    """One fresh process of `source`'s app; this file drives it, so any revision can be (-P:
    `source` first on the path, not this file's folder)."""
    command = [*pin, sys.executable, "-P", __file__, "--child", str(model)]
    command += ["--seconds", str(seconds)]
    done = subprocess.run(
        command,
        cwd=source,
        env={**os.environ, "PYTHONPATH": str(source)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the front end of {source} failed:\n{done.stderr[-3000:]}")
    return Round(**json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--against", metavar="REVISION", help="a git revision's app too")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seconds)
        return
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        model = make_tiny_model(Path(folder) / "tiny")
        targets = {"front end": here}
        if args.against:
            targets[f"front end at {args.against}"] = stack.enter_context(checkout(args.against))
        rounds: dict[str, list[float]] = {name: [] for name in targets}
        pin = pinning()
        for round_index in range(args.rounds):  # alternating, so that drift hits all alike
            for name in turns(list(targets), round_index):
                done = run_round(targets[name], pin, model, args.seconds)
                rounds[name].append(done.us_per_request)
                print(
                    f"{name}: {done.us_per_request:6.1f} µs of CPU per request "
                    f"({done.requests / args.seconds:.0f} requests/s)",
                    flush=True,
                )
    for name, figures in rounds.items():
        print(
            f"{name}: best {min(figures):.1f}, median {statistics.median(figures):.1f} µs of "
            f"CPU per request (of {len(figures)} rounds)"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"seconds": args.seconds, "rounds": rounds}, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
