"""The server's CPU per request over gRPC (tei.v1 Embed) against HTTP (POST /embed).

One server process per round (bench/serving_cost.py's: the tiny random model with the
default model's tokenizer, `--threads 1`, pinned to a core of its own by taskset), serving
both: `--port` and `--grpc-port`. Each round loads it with 32 connections of one request in
flight each, one short sentence per request (the same sentence on both paths), for --seconds
after 2 s of warm-up, first on one path then on the other (the order alternates between
rounds): HTTP from wrk, gRPC from h2load (nghttp2's C load generator: one unary call per
HTTP/2 request, its body the framed EmbedRequest), each pinned to the other core. CPU per
request is the utime + stime of the server's whole process tree over the run, over the
requests completed; each path keeps its best round. wrk checks every answer; for gRPC, the
server's own request counter (/metrics, read outside the measured runs) must count every
completed call as a success (a gRPC error travels in a 200 response's trailers, which h2load
does not read). A third process per round is gRPC's floor: a bare grpc.aio server (uvloop,
pinned alike) whose Embed parses the request and answers a fixed vector of 32 floats, for the
cost of a Python gRPC call itself. Written to bench/results/grpc_cost.json.
Usage: python -m bench.grpc_cost [--seconds 8] [--rounds 2] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import uvloop

from app.grpc.protocol import pb
from bench.serving_cost import (
    CONNECTIONS,
    DIMENSION,
    WARM_UP_SECONDS,
    Pinned,
    cpu_delta,
    load,
    make_tiny_model,
    pinning,
    tree,
)
from bench.workload import short_sentences
from bench.wrk import WRK_CORE, free_port

RESULTS = Path(__file__).resolve().parent / "results" / "grpc_cost.json"
EMBED = "/tei.v1.Embed/Embed"
COUNTED = re.compile(r'^embed_requests_total\{route="(?P<route>[^"]+)",status="(?P<status>\d+)"\}')


@dataclass(frozen=True)
class Load:
    """One load run: what the client saw."""

    requests: int  # completed (HTTP: answers wrk checked good; gRPC: responses h2load got)
    seconds: float
    bad: int  # wrong answers (HTTP) or calls the server did not count as successes (gRPC)
    p50_ms: float | None

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def grpc_body(text: str) -> bytes:
    """gRPC's length-prefixed message: not compressed (0), its length (4 bytes), the bytes."""
    message = pb.EmbedRequest(inputs=text).SerializeToString()
    return b"\x00" + len(message).to_bytes(4, "big") + message


def run_h2load(port: int, body: bytes, seconds: float) -> Load:
    h2load = shutil.which("h2load")
    if h2load is None:
        raise SystemExit("h2load is not installed (apt-get install nghttp2-client)")
    with tempfile.NamedTemporaryFile(suffix=".grpc") as handle:
        handle.write(body)
        handle.flush()
        command = [
            "taskset", "-c", WRK_CORE, h2load, f"--clients={CONNECTIONS}",
            "--max-concurrent-streams=1", f"--duration={seconds:g}", "--warm-up-time=0",
            f"--data={handle.name}", "--header=content-type: application/grpc",
            "--header=te: trailers", f"http://127.0.0.1:{port}{EMBED}",
        ]  # fmt: skip
        finished = subprocess.run(command, capture_output=True, text=True)
    output = finished.stdout
    if finished.returncode:
        raise SystemExit(f"h2load failed: {finished.stderr or output}")
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", output)
    took = re.search(r"finished in ([\d.]+)s", output)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", output)
    if done is None or took is None:
        raise SystemExit(f"h2load's output was not understood:\n{output}")
    p50 = None
    if mean is not None:  # h2load gives the mean, not the median
        p50 = float(mean[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean[2]]
    requests, succeeded = int(done[1]), int(done[2])
    return Load(requests, float(took[1]), requests - succeeded, p50)


def run_wrk(url: str, body: str, seconds: float) -> Load:
    result = load(url, [body], seconds)
    return Load(result.requests, result.seconds, result.bad + result.socket_errors, result.p50_ms)


def grpc_counts(url: str) -> dict[int, float]:
    """Embed calls the server counted, by the HTTP status of their outcome (200: OK)."""
    counts: dict[int, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = COUNTED.match(line)
        if match and match["route"] == EMBED:
            status = int(match["status"])
            counts[status] = counts.get(status, 0.0) + float(line.rpartition(" ")[2])
    return counts


@dataclass(frozen=True)
class Measured:
    load: Load
    cpu_seconds: float

    @property
    def us_per_request(self) -> float:
        return self.cpu_seconds / max(self.load.requests, 1) * 1e6

    def figures(self) -> dict[str, Any]:
        return {
            "requests_per_s": self.load.rate,
            "cpu_us_per_request": self.us_per_request,
            "cpu_seconds": self.cpu_seconds,
            "load": asdict(self.load),
        }


def measure_http(server: Pinned, body: str, seconds: float) -> Measured:
    run_wrk(server.url, body, WARM_UP_SECONDS)
    before = tree(server.process.pid)
    result = run_wrk(server.url, body, seconds)
    after = tree(server.process.pid)
    return Measured(result, cpu_delta(before, after, list(after)))


def measure_grpc(server: Pinned, port: int, body: bytes, seconds: float) -> Measured:
    run_h2load(port, body, WARM_UP_SECONDS)
    counted = grpc_counts(server.url)
    before = tree(server.process.pid)
    result = run_h2load(port, body, seconds)
    after = tree(server.process.pid)
    counted_after = grpc_counts(server.url)
    changed = {status: counted_after[status] - counted.get(status, 0.0) for status in counted_after}
    ok = changed.pop(200, 0.0)
    # Calls in flight when a run ends are cancelled by h2load: the server counts them as 499.
    failed = sum(count for status, count in changed.items() if status != 499)
    # Every call h2load completed must be one the server answered OK.
    bad = result.bad + int(failed) + max(0, result.requests - int(ok))
    checked = Load(result.requests, result.seconds, bad, result.p50_ms)
    return Measured(checked, cpu_delta(before, after, list(after)))


def serve_floor(port: int) -> None:
    """gRPC's floor: a bare grpc.aio server, Embed answering a fixed vector."""
    answer = pb.EmbedResponse(embeddings=[0.1] * DIMENSION)

    async def embed(request: pb.EmbedRequest, context: object) -> pb.EmbedResponse:
        return answer

    async def serve() -> None:
        server = grpc.aio.server()
        handlers = {
            "Embed": grpc.unary_unary_rpc_method_handler(
                embed,
                request_deserializer=pb.EmbedRequest.FromString,
                response_serializer=pb.EmbedResponse.SerializeToString,
            )
        }
        server.add_registered_method_handlers("tei.v1.Embed", handlers)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


def measure_floor(port: int, body: bytes, seconds: float) -> Measured:
    process = subprocess.Popen(
        [*pinning(), sys.executable, "-m", "bench.grpc_cost", "--floor-port", str(port)]
    )
    try:
        for _ in range(100):  # listening: a connection is accepted
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        run_h2load(port, body, WARM_UP_SECONDS)
        before = tree(process.pid)
        result = run_h2load(port, body, seconds)
        after = tree(process.pid)
        return Measured(result, cpu_delta(before, after, list(after)))
    finally:
        process.terminate()
        process.wait(10)


def server_command(model: Path, port: int, grpc_port: int, extra: Sequence[str]) -> list[str]:
    command = [*pinning(), sys.executable, "-m", "app", "--model-id", str(model)]
    command += ["--devices", "cpu", "--dtype", "float32", "--threads", "1"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)]
    return [*command, "--log-level", "warning", *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--floor-port", type=int, help=argparse.SUPPRESS)  # the floor's own
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    if args.floor_port:
        serve_floor(args.floor_port)
        return
    for tool, package in (("wrk", "wrk"), ("h2load", "nghttp2-client")):
        if shutil.which(tool) is None:  # before the model is made
            raise SystemExit(f"{tool} is not installed (apt-get install {package})")
    [sentence] = short_sentences(1, seed=5)
    http_body = orjson.dumps({"inputs": sentence}).decode()
    body = grpc_body(sentence)
    rounds: dict[str, list[Measured]] = {"http": [], "grpc": [], "floor": []}
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model(Path(folder) / "tiny")
        for index in range(args.rounds):
            port, grpc_port = free_port(), free_port()
            server = Pinned(server_command(model, port, grpc_port, args.server), port)
            try:
                server.wait_ready()
                order = ["http", "grpc"] if index % 2 == 0 else ["grpc", "http"]
                for path in order:
                    measured = (
                        measure_http(server, http_body, args.seconds)
                        if path == "http"
                        else measure_grpc(server, grpc_port, body, args.seconds)
                    )
                    rounds[path].append(measured)
            finally:
                server.stop()
            rounds["floor"].append(measure_floor(free_port(), body, args.seconds))
    report(rounds, args, sentence)


def report(rounds: dict[str, list[Measured]], args: argparse.Namespace, sentence: str) -> None:
    best = {path: min(runs, key=lambda m: m.us_per_request) for path, runs in rounds.items()}
    for path, runs in rounds.items():
        errors = sum(m.load.bad for m in runs)
        latency = best[path].load.p50_ms
        timing = f"; {'p50' if path == 'http' else 'mean'} {latency:.1f} ms" if latency else ""
        print(
            f"{path:5} {best[path].load.rate:7.0f} req/s, {best[path].us_per_request:6.1f} µs "
            f"of CPU per request (best of {len(runs)}{timing}; errors {errors})"
        )
    ratio = best["grpc"].us_per_request / best["http"].us_per_request
    print(f"grpc/http CPU per request: {ratio:.2f}x (floor: a bare grpc.aio call's own cost)")
    figures: dict[str, Any] = {
        "seconds": args.seconds,
        "connections": CONNECTIONS,
        "sentence": sentence,
        "server_flags": args.server,
        "grpc_over_http": ratio,
    }
    for path, runs in rounds.items():
        figures[path] = {
            "best": best[path].figures(),
            "rounds": [m.figures() for m in runs],
        }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
