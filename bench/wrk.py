"""Driving the real server with wrk, a C load generator that costs the server little.

wrk runs pinned to its cores (taskset; one by default), cycling through prepared bodies with
lua/embed.lua, which checks every answer (status, vector count, dimension).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

SCRIPT = Path(__file__).resolve().parent / "lua" / "embed.lua"
WRK_CORE = "0"
ENGINE_NAME = "embed-engine"  # the name (/proc/PID/comm) of the split placement's engines


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    bad: int
    socket_errors: int
    p50_ms: float
    p99_ms: float
    first_bad: str
    client_cpu_seconds: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def client_cores(self) -> float:
        """CPU wrk itself used, in cores: what it took from the server."""
        return self.client_cpu_seconds / self.seconds


@dataclass(frozen=True)
class ServerCpu:
    """CPU seconds the server's processes have used, by role and thread. The front ends'
    (and an in-process server's) main threads run the event loops (HTTP, validation,
    tokenization, responses); their other threads tokenize large requests (and, in process,
    run the model). The engines' processes read the front ends' submissions, run the batches
    and answer them (spin-waits included), all on one thread (app/engine/process.py)."""

    frontend_loops: float
    frontend_other: float
    engines: float

    def __sub__(self, earlier: ServerCpu) -> ServerCpu:
        return ServerCpu(
            self.frontend_loops - earlier.frontend_loops,
            self.frontend_other - earlier.frontend_other,
            self.engines - earlier.engines,
        )

    @property
    def total(self) -> float:
        return self.frontend_loops + self.frontend_other + self.engines


@dataclass(frozen=True)
class Batches:
    """Sums of the server's batch histograms (/metrics, over all engines)."""

    count: float
    inputs: float
    padding: float  # sum of each batch's padded share
    seconds: float  # sum of the forward passes' durations

    @classmethod
    def from_metrics(cls, exposition: str) -> Batches:
        """The sums in a Prometheus text exposition, over every label (models, engines)."""
        names = (
            "embed_batch_size_count",
            "embed_batch_size_sum",
            "embed_padding_ratio_sum",
            "embed_inference_duration_seconds_sum",
        )
        sums = dict.fromkeys(names, 0.0)
        for line in exposition.splitlines():
            sample, _, value = line.rpartition(" ")
            name = sample.partition("{")[0]
            if name in sums:
                sums[name] += float(value)
        return cls(*(sums[name] for name in names))

    def __sub__(self, earlier: Batches) -> Batches:
        return Batches(
            self.count - earlier.count,
            self.inputs - earlier.inputs,
            self.padding - earlier.padding,
            self.seconds - earlier.seconds,
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Server:
    """`python -m app` on a loopback port, with its peak memory read from /proc."""

    def __init__(
        self, flags: Sequence[str], env: dict[str, str] | None = None, source: Path | None = None
    ) -> None:
        """`source`: a checkout whose code the server runs (`python -m app` imports from its
        working directory first), else this one's."""
        self.port = free_port()
        self.engines = engines_in(flags)
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, "--log-level", "warning", *flags],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=source,
        )

    def wait_ready(self, within: float = 180, poll: float = 0.2) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit("the server exited during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(poll)
        raise SystemExit("the server did not become ready")

    def peak_rss_mib(self) -> float:
        """VmHWM, the most resident memory a process has had so far, summed over the server
        and its child processes (engines and front ends, under the split placement)."""
        pids = [self.process.pid, *children(self.process.pid)]
        return sum(peak_kib(pid) for pid in pids) / 1024

    def info(self) -> dict[str, object]:
        info: dict[str, object] = httpx.get(f"{self.url}/info", timeout=10).json()
        return info

    def cpu(self) -> ServerCpu:
        """Read from /proc: a thread's CPU is fields 14 and 15 (utime, stime) of its stat; an
        engine is a process named ENGINE_NAME (its comm)."""
        tick = os.sysconf("SC_CLK_TCK")
        seconds = {"loops": 0.0, "other": 0.0, "engines": 0.0}
        for pid in [self.process.pid, *children(self.process.pid)]:
            try:
                engine = Path(f"/proc/{pid}/comm").read_text().strip() == ENGINE_NAME
            except OSError:  # exited meanwhile
                continue
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                role = "engines" if engine else "loops" if task.name == str(pid) else "other"
                seconds[role] += (int(fields[11]) + int(fields[12])) / tick
        return ServerCpu(seconds["loops"], seconds["other"], seconds["engines"])

    def batches(self) -> Batches:
        return Batches.from_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def settle(self, probes: int = 8) -> None:
        """Return once the work clients left behind is done: when wrk stops, the batches
        already running for its connections still run (seconds, for long passages on 2
        cores), and would land in the next load's latencies. Each probe, on a connection of
        its own (so that the kernel spreads them over the front ends), is answered only after
        its engine's running batch."""
        body = {"inputs": ["settle"]}
        with ThreadPoolExecutor(probes) as pool:
            answers = pool.map(
                lambda _: httpx.post(f"{self.url}/embed", json=body, timeout=60), range(probes)
            )
            for answer in answers:
                answer.raise_for_status()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


def engines_in(flags: Sequence[str]) -> int:
    """The engines that run forward passes: one per device in --devices, if the flags give
    it."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--devices", default="cpu")
    devices: str = parser.parse_known_args(flags)[0].devices
    return len(devices.split(","))


def core_list(cores: str) -> list[int]:
    """The CPUs of a taskset list such as "0", "0-3" or "0,2-3"."""
    found: list[int] = []
    for part in cores.split(","):
        first, _, last = part.partition("-")
        found.extend(range(int(first), int(last or first) + 1))
    return found


def children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes."""
    listing = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in listing.read_text().split()] if listing.exists() else []


def peak_kib(pid: int) -> int:
    """A process's VmHWM in KiB: the most resident memory it has had so far (0 once gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # exited meanwhile
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))


def run_wrk(
    url: str,
    bodies: Sequence[str],
    *,
    connections: int,
    seconds: float,
    vectors: int,
    dimension: int,
    path: str = "/embed",
    cores: str = WRK_CORE,
) -> WrkResult:
    """One wrk run, a thread on each of `cores` (taskset's list: "0", "0-3") up to one per
    connection; every response is checked, and any bad one is reported."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as handle:
        handle.write("\n".join(bodies) + "\n")
        bodies_file = handle.name
    threads = min(len(core_list(cores)), connections)
    command = [
        "taskset", "-c", cores, wrk, f"-t{threads}", f"-c{connections}",
        f"-d{max(1, round(seconds))}s", "--timeout", "30s", "-s", str(SCRIPT), url,
        "--", bodies_file, path, str(vectors), str(dimension),
    ]  # fmt: skip
    before = os.times()
    try:
        finished = subprocess.run(command, capture_output=True, text=True)
    finally:
        os.unlink(bodies_file)
    if finished.returncode:
        raise SystemExit(f"wrk failed: {finished.stderr or finished.stdout}")
    output = finished.stdout
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    summary = json.loads(output.strip().splitlines()[-1])
    return WrkResult(**summary, client_cpu_seconds=cpu)
