"""Soak and overload: the real server on loopback under sustained mixed traffic.

Phases (all by default; --phases picks some):
1. soak: `wrk` (pinned to one core) keeps the server saturated for --duration seconds with
   mixed requests cycled from prepared bodies: 1 to 64 inputs of 5 to 500 tokens, /embed,
   OpenAI float and base64, /encode with attention maps or per-token vectors. Per minute:
   requests, errors, p50/p99 latency and the server's RSS.
2. overload: an open-loop client offers 3x the rate the server sustains (measured first) of
   /embed and /v1/embeddings requests for --overload seconds. Every 200 is checked against
   the vectors the unloaded server gave for the same body; 429s are timed; then the time
   until a probe's latency is back to its unloaded level.
3. abuse: clients that disconnect right after sending a large request, and clients that
   send their body one byte a second, while a probe measures a normal client's latency;
   then the queue must be empty.
Figures are printed and written as JSON (bench/results/). --malloc glibc runs the server with
glibc's default arenas (MALLOC_ARENA_MAX = 8 x cores) and no trimming, to compare against
app/memory.py's tuning.

Usage: python -m bench.soak [--duration 600] [--phases soak,overload,abuse]
       [--malloc tuned|glibc] [--out FILE] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import orjson
from tokenizers import Tokenizer

from model import DEFAULT_MODEL_ID
from model.resolve import resolve_model_dir

HOST = "127.0.0.1"
LUA = Path(__file__).resolve().parent / "lua" / "soak.lua"
RESULTS = Path(__file__).with_name("results")
# The server's glibc arenas and trimming turned off (app/memory.py untouched otherwise).
WITHOUT_TRIM = (
    "import app.memory as m; m.Trimmer.maybe_trim = lambda self: None; "
    "from app.__main__ import main; main()"
)
OVERLOAD_FACTOR = 3
# Seconds a client keeps an idle connection (uvicorn closes them after 5).
KEEP_ALIVE = 3.0
PROBE = orjson.dumps({"inputs": "A short sentence to time a normal client by."})
FloatArray = npt.NDArray[np.float32]


class Connection:
    """A lean keep-alive HTTP/1.1 client (httpx costs milliseconds of CPU per request, which
    on this machine the server would lose): one request at a time, Content-Length answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        return cls(*await asyncio.open_connection(host, port))

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """Send a JSON body as it is; the status and the body of the answer."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.writer.write(head.encode("ascii") + payload)
        status_line = await self.reader.readuntil(b"\r\n")
        length = 0
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


# Traffic ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    path: str
    body: bytes
    kind: str
    inputs: int
    tokens: int  # before truncation, [CLS] and [SEP] included


def single_token_words() -> list[str]:
    """Words the default model's vocabulary holds whole: each is exactly one token."""
    folder = resolve_model_dir(DEFAULT_MODEL_ID, allow_download=False)
    vocabulary = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    return sorted(w for w in vocabulary if w.isascii() and w.isalpha() and len(w) >= 3)


class Traffic:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.words = single_token_words()

    def text(self, tokens: int) -> str:
        return " ".join(self.rng.choices(self.words, k=max(1, tokens - 2)))

    def tokens(self, low: int, high: int) -> int:
        """Log-uniform: short inputs are common, long ones are not rare."""
        return int(math.exp(self.rng.uniform(math.log(low), math.log(high + 1))))

    def count(self, high: int) -> int:
        bucket = self.rng.choices([(1, 1), (2, 8), (9, 32), (33, 64)], [30, 30, 25, 15])[0]
        return min(high, self.rng.randint(*bucket))

    def soak_request(self) -> Prepared:
        """1 to 64 inputs of 5 to 500 tokens; each kind within the server's default limits."""
        kind = self.rng.choices(
            ["embed", "openai-float", "openai-base64", "encode-attention", "encode-tokens"],
            [55, 10, 10, 12.5, 12.5],
        )[0]
        path = "/encode"
        if kind == "encode-attention":  # mean maps of one layer: T x T floats per input
            texts = [self.text(self.tokens(5, 500)) for _ in range(self.count(4))]
            body: dict[str, Any] = {
                "inputs": texts,
                "attention": {"layers": [self.rng.choice([0, -1])], "reduce": "mean"},
                "encoding": self.rng.choice(["float", "base64"]),
            }
        elif kind == "encode-tokens":  # T x 384 floats per input
            texts = [self.text(self.tokens(5, 200)) for _ in range(self.count(4))]
            body = {
                "inputs": texts,
                "token_embeddings": True,
                "encoding": self.rng.choice(["float", "base64"]),
            }
        elif kind == "embed":
            texts = [self.text(self.tokens(5, 500)) for _ in range(self.count(64))]
            body, path = {"inputs": texts}, "/embed"
        else:
            texts = [self.text(self.tokens(5, 500)) for _ in range(self.count(64))]
            body = {"input": texts, "encoding_format": kind.removeprefix("openai-")}
            path = "/v1/embeddings"
        tokens = sum(len(t.split()) + 2 for t in texts)
        return Prepared(path, orjson.dumps(body), kind, len(texts), tokens)

    def checked_request(self) -> Prepared:
        """What the overload phase sends: answers that are vectors, checked one by one."""
        texts = [self.text(self.tokens(5, 128)) for _ in range(self.count(16))]
        if self.rng.random() < 0.5:
            body: dict[str, Any] = {"inputs": texts}
            path, kind = "/embed", "embed"
        else:
            body = {"input": texts, "encoding_format": "base64"}
            path, kind = "/v1/embeddings", "openai-base64"
        tokens = sum(len(t.split()) + 2 for t in texts)
        return Prepared(path, orjson.dumps(body), kind, len(texts), tokens)


def vectors_of(prepared: Prepared, answer: bytes) -> FloatArray:
    body = orjson.loads(answer)
    if prepared.path == "/embed":
        return np.asarray(body, dtype=np.float32)
    raw = [base64.b64decode(item["embedding"]) for item in body["data"]]
    return np.stack([np.frombuffer(item, dtype="<f4") for item in raw])


def min_cosine(got: FloatArray, want: FloatArray) -> float:
    """The lowest cosine between matching rows; -1 when the shapes differ."""
    if got.shape != want.shape:
        return -1.0
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    return float(((got * want).sum(axis=1) / norms).min())


def write_requests(path: Path, requests: list[Prepared]) -> None:
    with path.open("wb") as out:
        for request in requests:
            out.write(request.path.encode() + b"\t" + request.body + b"\n")


# The server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


class Server:
    def __init__(self, flags: list[str], malloc: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if malloc == "glibc":
            env["MALLOC_ARENA_MAX"] = str(8 * (os.cpu_count() or 1))
            entry = ["-c", WITHOUT_TRIM]
        else:
            env.pop("MALLOC_ARENA_MAX", None)
            entry = ["-m", "app"]
        args = ["--host", HOST, "--port", str(self.port), "--devices", "cpu", *flags]
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, *entry, *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, within: float = 300) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited during start-up:\n{self.log.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise SystemExit("the server did not become ready")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                # Summed over labels: the queue of every served model.
                family = name.partition("{")[0]
                values[family] = values.get(family, 0.0) + float(value)
        return values

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(f"{self.url}/info", timeout=30).json()
        return info

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class RssSampler:
    """The server's RSS once a second, in a background thread."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(OSError, RuntimeError):
                self.samples.append((time.monotonic(), self.server.rss_mb()))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[float]:
        return [rss for at, rss in self.samples if start <= at <= end]


# Phase 1: soak ---------------------------------------------------------------------------
def run_wrk(
    server: Server, requests_file: Path, seconds: int, connections: int, core: int
) -> dict[str, Any]:
    command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "120s"]
    command += ["-s", str(LUA), server.url, "--", str(requests_file)]
    if shutil.which("taskset"):
        # On its own core, so that the load generator does not take the server's CPU.
        command = ["taskset", "-c", str(core), *command]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def errors_of(wrk: dict[str, Any]) -> int:
    return int(wrk["non_2xx"]) + sum(int(v) for v in wrk["socket_errors"].values())


def soak(
    server: Server, sampler: RssSampler, requests_file: Path, args: argparse.Namespace
) -> dict[str, Any]:
    minutes: list[dict[str, Any]] = []
    remaining = args.duration
    while remaining > 0:
        seconds = min(60, remaining)
        started = time.monotonic()
        wrk = run_wrk(server, requests_file, seconds, args.connections, args.wrk_core)
        rss = sampler.between(started, time.monotonic())
        minute = {
            "minute": len(minutes) + 1,
            "seconds": round(wrk["duration_us"] / 1e6, 1),
            "requests": wrk["requests"],
            "requests_per_second": round(wrk["requests"] / (wrk["duration_us"] / 1e6), 1),
            "errors": errors_of(wrk),
            "statuses": wrk["statuses"],
            "p50_ms": round(wrk["latency_us"]["p50"] / 1000, 1),
            "p99_ms": round(wrk["latency_us"]["p99"] / 1000, 1),
            "rss_mb": round(server.rss_mb(), 1),
            # Sampled each second: a leak raises the floor, transient bodies the peaks.
            "rss_min_mb": round(min(rss, default=0.0), 1),
            "rss_max_mb": round(max(rss, default=0.0), 1),
        }
        print(f"soak minute {minute['minute']}: {json.dumps(minute)}", flush=True)
        minutes.append(minute)
        remaining -= seconds
    result: dict[str, Any] = {
        "minutes": minutes,
        "requests": sum(m["requests"] for m in minutes),
        "errors": sum(m["errors"] for m in minutes),
    }
    if len(minutes) >= 3:
        for key in ("rss_mb", "rss_min_mb", "rss_max_mb"):
            second, last = minutes[1][key], minutes[-1][key]
            growth = round(100 * (last - second) / second, 1)
            result[f"{key.removesuffix('_mb')}_growth_from_minute_2_pct"] = growth
    return result


# Phase 2: overload -----------------------------------------------------------------------
@dataclass
class Overload:
    sent: int = 0
    accepted: int = 0
    correct: int = 0
    wrong: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    latency: dict[int, list[float]] = field(default_factory=dict)
    min_cosine: float = 1.0
    not_sent: int = 0  # arrivals with every allowed connection busy
    client_lag: list[float] = field(default_factory=list)


async def probe_once(connection: Connection) -> float:
    """Seconds a short /embed takes; infinite when it is refused (429 while the queue is
    full, after an overload)."""
    sent = time.perf_counter()
    status, answer = await connection.post("/embed", PROBE)
    if status == 429:
        return math.inf
    if status != 200:
        raise SystemExit(f"a probe got {status}: {answer[:200]!r}")
    return time.perf_counter() - sent


async def probe_latencies(port: int, count: int) -> list[float]:
    connection = await Connection.open(HOST, port)
    try:
        return [await probe_once(connection) for _ in range(count)]
    finally:
        await connection.close()


async def reference_vectors(port: int, requests: list[Prepared]) -> list[FloatArray]:
    """What the unloaded server answers for each body, one request at a time."""
    connection = await Connection.open(HOST, port)
    try:
        answers = []
        for request in requests:
            status, answer = await connection.post(request.path, request.body)
            assert status == 200, answer[:200]
            answers.append(vectors_of(request, answer))
        return answers
    finally:
        await connection.close()


async def offer(
    port: int,
    requests: list[Prepared],
    expected: list[FloatArray],
    rate: float,
    seconds: float,
    tolerance: float,
    max_connections: int,
    done: asyncio.Event,
) -> Overload:
    """Open loop: a request every 1/rate seconds whatever the answers, each on an idle
    connection or a new one; sets `done` when the last request is sent, and returns when
    every answer is in."""
    outcome = Overload()
    idle: list[tuple[float, Connection]] = []  # with the time each was last used
    open_connections = 0

    async def watch_lag() -> None:
        """How late this client's own event loop wakes up: its share of measured latency."""
        while not done.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(0.01)
            outcome.client_lag.append(time.perf_counter() - asked - 0.01)

    async def one(index: int) -> None:
        nonlocal open_connections
        # uvicorn closes a connection idle for 5 s: such ones (the oldest) are closed here.
        while idle and idle[0][0] < time.monotonic() - KEEP_ALIVE:
            _, stale = idle.pop(0)
            open_connections -= 1
            await stale.close()
        if idle:
            _, connection = idle.pop()
        elif open_connections < max_connections:
            open_connections += 1
            connection = await Connection.open(HOST, port)
        else:
            outcome.not_sent += 1
            return
        request = requests[index % len(requests)]
        outcome.sent += 1
        sent = time.perf_counter()
        try:
            status, answer = await connection.post(request.path, request.body)
        except (OSError, asyncio.IncompleteReadError) as exc:
            outcome.statuses[0] += 1
            outcome.wrong.append(f"{type(exc).__name__}: {exc}")
            open_connections -= 1
            return
        outcome.latency.setdefault(status, []).append(time.perf_counter() - sent)
        outcome.statuses[status] += 1
        idle.append((time.monotonic(), connection))
        if status == 200:
            outcome.accepted += 1
            cosine = min_cosine(vectors_of(request, answer), expected[index % len(requests)])
            outcome.min_cosine = min(outcome.min_cosine, cosine)
            if cosine >= tolerance:
                outcome.correct += 1
            else:
                outcome.wrong.append(f"request {index}: cosine {cosine:.6f}")
        elif status != 429:
            outcome.wrong.append(f"request {index}: status {status} {answer[:200]!r}")

    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    lag = asyncio.create_task(watch_lag())
    start = loop.time()
    index = 0
    while loop.time() < start + seconds:
        delay = start + index / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(index))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        index += 1
    done.set()
    await lag
    while tasks:  # every accepted request completes (or fails, counted)
        await asyncio.gather(*list(tasks))
    for _, connection in idle:
        await connection.close()
    return outcome


async def recovery(port: int, level: float, within: float = 120) -> float | None:
    """Seconds until three probes in a row answer within `level` seconds."""
    connection = await Connection.open(HOST, port)
    started = time.perf_counter()
    streak = 0
    try:
        while time.perf_counter() - started < within:
            streak = streak + 1 if await probe_once(connection) <= level else 0
            if streak == 3:
                return round(time.perf_counter() - started, 2)
            await asyncio.sleep(0.2)
        return None
    finally:
        await connection.close()


def percentile_ms(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(values[0] * 1000, 1) if values else None
    return round(statistics.quantiles(values, n=100)[q - 1] * 1000, 1)


def overload(
    server: Server, sampler: RssSampler, traffic: Traffic, args: argparse.Namespace
) -> dict[str, Any]:
    requests = [traffic.checked_request() for _ in range(64)]
    expected = asyncio.run(reference_vectors(server.port, requests))
    unloaded = asyncio.run(probe_latencies(server.port, 30))
    with tempfile.NamedTemporaryFile("wb", suffix=".requests") as file:
        write_requests(Path(file.name), requests)
        calibration = run_wrk(server, Path(file.name), 20, args.connections, args.wrk_core)
    sustained = calibration["requests"] / (calibration["duration_us"] / 1e6)
    rate = OVERLOAD_FACTOR * sustained
    tolerance = 0.99999 if server.info()["dtype"] == "float32" else 0.999
    print(f"overload: sustained {sustained:.1f} requests/s, offering {rate:.1f}", flush=True)
    started = time.monotonic()

    async def load_then_recover() -> tuple[Overload, float | None, float | None]:
        stopped = asyncio.Event()
        load = asyncio.create_task(
            offer(
                server.port,
                requests,
                expected,
                rate,
                args.overload,
                tolerance,
                args.max_open,
                stopped,
            )
        )
        await stopped.wait()
        # From the moment the offered load drops (accepted requests are still finishing):
        # until a probe is back within 1.5 times the slowest unloaded probe, and until the
        # queue is empty.
        dropped = time.monotonic()
        recovered = await recovery(server.port, 1.5 * max(unloaded))
        drained = await asyncio.to_thread(queue_after, server)
        emptied = time.monotonic() - dropped if drained["embed_queue_depth"] == 0 else None
        return await load, recovered, emptied

    outcome, recovered, emptied = asyncio.run(load_then_recover())
    rss = sampler.between(started, time.monotonic())
    return {
        "sustained_requests_per_second": round(sustained, 1),
        "offered_requests_per_second": round(rate, 1),
        "seconds": args.overload,
        "sent": outcome.sent,
        "not_sent_client_connections_busy": outcome.not_sent,
        "statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
        "accepted": outcome.accepted,
        "accepted_correct": outcome.correct,
        "min_cosine": round(outcome.min_cosine, 6),
        "problems": outcome.wrong[:20],
        "latency_200_ms": {
            "p50": percentile_ms(outcome.latency.get(200, []), 50),
            "p99": percentile_ms(outcome.latency.get(200, []), 99),
        },
        "latency_429_ms": {
            "p50": percentile_ms(outcome.latency.get(429, []), 50),
            "p99": percentile_ms(outcome.latency.get(429, []), 99),
        },
        # Latencies are measured by this client, on the same two cores: its own event loop's
        # lateness is part of them.
        "client_event_loop_lag_ms": {
            "p50": percentile_ms(outcome.client_lag, 50),
            "p99": percentile_ms(outcome.client_lag, 99),
        },
        "unloaded_probe_ms": {
            "p50": percentile_ms(unloaded, 50),
            "max": round(max(unloaded) * 1000, 1),
        },
        "probe_back_to_unloaded_after_load_drops_s": recovered,
        "queue_empty_after_load_drops_s": round(emptied, 1) if emptied is not None else None,
        "rss_mb": {"before": round(rss[0], 1) if rss else None, "max": round(max(rss), 1)},
    }


# Phase 3: disconnecting and slow clients -------------------------------------------------
async def disconnecting_client(port: int, body: bytes, stop: asyncio.Event) -> int:
    """Send a large request, go away 50 ms later (it has been read and queued by then),
    once a second; how many were sent."""
    sent = 0
    head = (
        f"POST /embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        _, writer = await asyncio.open_connection(HOST, port)
        writer.write(head + body)
        await writer.drain()
        sent += 1
        await asyncio.sleep(0.05)
        writer.transport.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return sent


async def slow_client(port: int, stop: asyncio.Event) -> None:
    """Declare a 1,000-byte body and send it one byte a second."""
    _, writer = await asyncio.open_connection(HOST, port)
    writer.write(
        f"POST /embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n{".encode()
    )
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        writer.write(b" ")
    writer.transport.abort()


async def abuse(server: Server, body: bytes, seconds: float, clients: int) -> dict[str, Any]:
    port = server.port
    computed_before = (await asyncio.to_thread(server.metrics))["embed_batch_size_sum"]
    before = await probe_latencies(port, 40)
    stop = asyncio.Event()
    disconnecting = [
        asyncio.create_task(disconnecting_client(port, body, stop)) for _ in range(clients)
    ]
    slow = [asyncio.create_task(slow_client(port, stop)) for _ in range(clients)]
    await asyncio.sleep(2)  # the abusers are at it
    during: list[float] = []
    connection = await Connection.open(HOST, port)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        during.append(await probe_once(connection))
    await connection.close()
    stop.set()
    sent = sum(await asyncio.gather(*disconnecting))
    await asyncio.gather(*slow)
    await asyncio.to_thread(queue_after, server)
    computed = (await asyncio.to_thread(server.metrics))["embed_batch_size_sum"]
    abandoned = computed - computed_before - len(before) - len(during)
    return {
        "seconds": seconds,
        "disconnecting_clients": clients,
        "slow_clients": clients,
        "abandoned_requests_sent": sent,
        "abandoned_inputs_sent": sent * len(orjson.loads(body)["inputs"]),
        # Inputs that went through a forward pass although their client had gone: those a
        # batch took in the 50 ms before the client left.
        "abandoned_inputs_computed": int(abandoned),
        "probe_before_ms": {"p50": percentile_ms(before, 50), "p99": percentile_ms(before, 99)},
        "probe_during_ms": {"p50": percentile_ms(during, 50), "p99": percentile_ms(during, 99)},
        "probes_during": len(during),
    }


def queue_after(server: Server, within: float = 60) -> dict[str, float]:
    """The queue once the server has had time to finish or drop what it holds."""
    deadline = time.monotonic() + within
    while True:
        values = server.metrics()
        depth, tokens = values["embed_queue_depth"], values["embed_queue_tokens"]
        if (depth == 0 and tokens == 0) or time.monotonic() > deadline:
            return {"embed_queue_depth": depth, "embed_queue_tokens": tokens}
        time.sleep(0.5)


# Main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=600, help="soak seconds")
    parser.add_argument("--overload", type=float, default=60, help="overload seconds")
    parser.add_argument("--abuse", type=float, default=20, help="abuse seconds")
    parser.add_argument("--phases", default="soak,overload,abuse")
    parser.add_argument("--connections", type=int, default=16, help="wrk keep-alive connections")
    parser.add_argument("--clients", type=int, default=16, help="each kind of abusive client")
    # Below the server's --max-connections (1,024): past it a fast 503 would answer, not 429.
    parser.add_argument("--max-open", type=int, default=1000, help="overload connections")
    parser.add_argument("--wrk-core", type=int, default=(os.cpu_count() or 1) - 1)
    parser.add_argument("--malloc", choices=["tuned", "glibc"], default="tuned")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON file (default: bench/results/...)")
    parser.add_argument("server_flags", nargs="*", help="after --, flags for the server")
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    if "soak" in phases and not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (apt-get install wrk)")

    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS / f"soak-{stamp}-{args.malloc}.json"
    traffic = Traffic(args.seed)
    soak_requests = [traffic.soak_request() for _ in range(400)]
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, "-m", "bench.soak", *(argv or sys.argv[1:])]),
        "malloc": args.malloc,
        "server_flags": args.server_flags,
        "load_average_at_start": os.getloadavg(),
        "mix": {
            "requests": len(soak_requests),
            "kinds": Counter(r.kind for r in soak_requests),
            "inputs_per_request_mean": round(statistics.mean(r.inputs for r in soak_requests), 1),
            "tokens_per_request_mean": round(statistics.mean(r.tokens for r in soak_requests)),
        },
    }
    server = Server(args.server_flags, args.malloc, out.with_suffix(".log"))
    try:
        server.wait_ready()
        info = server.info()
        report["server"] = {"dtype": info["dtype"], "device": info["device"]}
        report["rss_mb_ready"] = round(server.rss_mb(), 1)
        with RssSampler(server) as sampler, tempfile.TemporaryDirectory() as scratch:
            requests_file = Path(scratch) / "soak.requests"
            write_requests(requests_file, soak_requests)
            if "soak" in phases:
                report["soak"] = soak(server, sampler, requests_file, args)
                report["queue_after_soak"] = queue_after(server)
            if "overload" in phases:
                report["overload"] = overload(server, sampler, traffic, args)
                report["queue_after_overload"] = queue_after(server)
            if "abuse" in phases:
                big = orjson.dumps({"inputs": [traffic.text(256) for _ in range(16)]})
                report["abuse"] = asyncio.run(abuse(server, big, args.abuse, args.clients))
                report["queue_after_abuse"] = queue_after(server)
        metrics = server.metrics()
        report["client_disconnects_counted"] = metrics.get(
            'embed_failures_total{reason="ClientDisconnected"}', 0.0
        )
        report["rss_mb_end"] = round(server.rss_mb(), 1)
    finally:
        report["exit_code"] = server.stop()
    report["load_average_at_end"] = os.getloadavg()
    report["tracebacks_in_server_log"] = server.log.read_text().count("Traceback")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"written to {out}")
    return report


if __name__ == "__main__":
    main()
