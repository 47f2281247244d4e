"""An engine process's own CPU per input outside its forward passes, on a core of its own.

bench.serving_cost reads this figure with the front end on the engine's core, where each
evicts the other's caches; on a GPU machine an engine has cores to itself, and what it spends
per input outside its passes bounds how many single sentences a second it can feed the device.
Here the split server (the tiny model of bench.serving_cost, pinned to one core) keeps its
front end idle: this process, pinned to wrk's core, writes one-input requests straight to the
engine's socket as a front end does (app/engine/wire.py), keeping --in-flight of them
outstanding, and checks every reply. The engine's CPU (utime + stime from /proc) less its
passes' (embed_forward_cpu_seconds_total) over the inputs answered is the figure; with
--against REVISION that revision's engine takes its turn in every round, each round a fresh
server, and each keeps its best round. All is written to bench/results/engine_cost.json.
Usage: python -m bench.engine_cost [--seconds 5] [--rounds 3] [--in-flight 32]
                                   [--against REV] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

from app.engine.wire import (
    Answers,
    Frames,
    Submit,
    encoded_message,
    framed_requests,
    reply_decoder,
)
from bench.serving_cost import (
    DIMENSION,
    FORWARD_SECONDS,
    Pinned,
    cpu_delta,
    make_tiny_model,
    metric_sums,
    pinning,
    tree,
)
from bench.side_by_side import checkout, turns
from bench.workload import short_sentences
from bench.wrk import ENGINE_NAME, WRK_CORE, free_port

RESULTS = Path(__file__).resolve().parent / "results" / "engine_cost.json"
WARM_UP_SECONDS = 1.5
VECTOR_BYTES = DIMENSION * 4
# A submission's deadline on the engine's clock (perf_counter seconds), past any run: the
# messages are made once and sent again and again, round after round. (A revision before
# 9ab5016 reads it as seconds left, as long a time.)
NO_DEADLINE = 1e9


@dataclass(frozen=True)
class Round:
    inputs: int
    seconds: float
    cpu_seconds: float  # the engine processes'
    forward_seconds: float

    @property
    def us_per_input(self) -> float:
        return (self.cpu_seconds - self.forward_seconds) / max(self.inputs, 1) * 1e6

    @property
    def outside_over_forward(self) -> float:
        """The same work against the passes': a figure this machine's drift moves less."""
        return (self.cpu_seconds - self.forward_seconds) / max(self.forward_seconds, 1e-9)


class EngineClient:
    """A front end's side of one engine's socket: submissions out, checked replies in."""

    def __init__(self, path: Path, messages: Sequence[msgspec.Raw]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.frames = Frames()
        self.messages = messages
        self.sent = 0

    def send(self, count: int) -> None:
        if not count:  # the last read held only part of a message
            return
        batch = [self.messages[(self.sent + i) % len(self.messages)] for i in range(count)]
        self.sock.sendall(framed_requests(batch))
        self.sent += count

    def replies(self) -> int:
        """Waits for replies; how many came, each checked."""
        data = self.sock.recv(1 << 20)
        if not data:
            raise SystemExit(
                "the engine closed its connection (an --against revision that reads another "
                "wire protocol than this checkout's?)"
            )
        answered = 0
        for raw in self.frames.feed(data):
            message = reply_decoder.decode(raw)
            if (
                not isinstance(message, Answers)
                or len(message.vectors or b"") != len(message.requests) * VECTOR_BYTES
            ):
                raise SystemExit(f"the engine answered: {message!r}")
            answered += len(message.requests)
        return answered

    def drive(self, seconds: float, in_flight: int) -> int:
        """Keeps `in_flight` requests outstanding for `seconds`, then waits for the last
        ones; the inputs answered."""
        started, answered = self.sent, 0
        self.send(in_flight)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            arrived = self.replies()
            answered += arrived
            self.send(arrived)
        while answered < self.sent - started:
            answered += self.replies()
        return answered

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class Target:
    name: str
    source: Path | None  # the checkout its server runs from; None: this one


def engine_socket(run_parent: Path) -> Path:
    """The first engine's socket in the split server's run folder, the one folder its
    supervisor made in `run_parent` (its TMPDIR); there once the server is ready, as its
    front ends connect to it before they listen."""
    found = sorted(run_parent.glob("*/**/engine-0.sock"))
    if not found:
        raise SystemExit(f"no engine socket under {run_parent}")
    return found[0]


def run_round(
    target: Target,
    pin: Sequence[str],
    model: Path,
    extra: Sequence[str],
    messages: Sequence[msgspec.Raw],
    args: argparse.Namespace,
) -> Round:
    """A fresh server: this machine's speed drifts, and one process's speed is a draw."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="engine-cost-") as run_parent:
        command = ["env", f"TMPDIR={run_parent}", *pin, sys.executable, "-m", "app"]
        command += ["--model-id", str(model), "--devices", "cpu", "--dtype", "float32"]
        command += ["--threads", "1", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--log-level", "warning", "--placement", "split", *extra]
        server = Pinned(command, port, target.source)
        try:
            server.wait_ready()
            client = EngineClient(engine_socket(Path(run_parent)), messages)
            try:
                client.drive(WARM_UP_SECONDS, args.in_flight)
                forward = metric_sums(server.url)[FORWARD_SECONDS]
                before = tree(server.process.pid)
                started = time.perf_counter()
                inputs = client.drive(args.seconds, args.in_flight)
                seconds = time.perf_counter() - started
                after = tree(server.process.pid)
                forward = metric_sums(server.url)[FORWARD_SECONDS] - forward
            finally:
                client.close()
        finally:
            server.stop()
    engines = [pid for pid, proc in after.items() if proc.name == ENGINE_NAME]
    return Round(inputs, seconds, cpu_delta(before, after, engines), forward)


def submissions(model: Path) -> list[msgspec.Raw]:
    """One-input requests of short sentences, encoded as a front end encodes them."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_padding()
    ids = [tokenizer.encode(text).ids for text in short_sentences(4096, seed=5)]
    return [
        encoded_message(
            Submit(request, NO_DEADLINE, [row], [0], None, True, True, None, False, None)
        )
        for request, row in enumerate(ids)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=32, help="requests kept outstanding")
    parser.add_argument("--against", metavar="REVISION", help="a git revision's engine too")
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    pin = pinning()  # the server's core, before this process takes wrk's
    os.sched_setaffinity(0, {int(WRK_CORE)})
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        model = make_tiny_model(Path(folder) / "tiny")
        messages = submissions(model)
        every = [Target("engine", None)]
        if args.against:
            every.append(
                Target(f"engine at {args.against}", stack.enter_context(checkout(args.against)))
            )
        rounds: dict[str, list[Round]] = {target.name: [] for target in every}
        for round_index in range(args.rounds):  # alternating, so that drift hits all alike
            for target in turns(every, round_index):
                done = run_round(target, pin, model, args.server, messages, args)
                rounds[target.name].append(done)
                print(
                    f"{target.name}: {done.inputs / done.seconds:7.0f} inputs/s, "
                    f"{done.us_per_input:5.1f} µs per input outside the passes "
                    f"({done.outside_over_forward:.2f}x the passes' CPU)",
                    flush=True,
                )
    report(rounds, args)


def report(rounds: dict[str, list[Round]], args: argparse.Namespace) -> None:
    figures: dict[str, object] = {"seconds": args.seconds, "in_flight": args.in_flight}
    for name, runs in rounds.items():
        best = min(runs, key=lambda r: r.us_per_input)
        print(
            f"{name}: best {best.us_per_input:.1f} µs per input outside the forward passes, "
            f"{best.outside_over_forward:.2f}x the passes' CPU (of {len(runs)} rounds)"
        )
        figures[name] = {
            "best_us_per_input": best.us_per_input,
            "rounds": [
                {
                    **asdict(r),
                    "us_per_input": r.us_per_input,
                    "over_forward": r.outside_over_forward,
                }
                for r in runs
            ],
        }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
