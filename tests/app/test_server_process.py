"""End to end: the real server process, the real default model, a loopback port."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from model import Embedder
from model.device import resolve_dtype

pytestmark = pytest.mark.anyio
LONG_TEXT = "throughput latency batching padding " * 50  # about 200 tokens after truncation


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ServerProcess:
    def __init__(
        self, tmp_path: Path, *flags: str, devices: str = "cpu", threads: str = "2"
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"server-{self.port}.log"
        command = [
            sys.executable,
            "-m",
            "app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--devices",
            devices,
            "--threads",
            threads,
            *flags,
        ]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_ready(self, within: float = 120.0, frontends: int = 0) -> None:
        """Until /health says 200 and `frontends` HTTP processes have logged their start-up
        (/health is answered by whichever the kernel picks, while others may still start)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                healthy = httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                healthy = False
            started = self.log.read_text().count("Application startup complete")
            if healthy and started >= frontends:
                return
            time.sleep(0.2)
        raise AssertionError(f"server not ready:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path)
    try:
        process.wait_ready()
        yield process
    finally:
        if process.process.poll() is None:
            process.process.kill()


async def test_real_server_serves_the_default_model(
    server: ServerProcess, minilm: Embedder
) -> None:
    texts = ["The cat sits on the mat.", "Größe und Übermaß 🚀", LONG_TEXT]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        embed = await client.post("/embed", json={"inputs": texts})
        openai_body = (
            await client.post("/v1/embeddings", json={"input": texts[0], "model": "m"})
        ).json()
        encode = (
            await client.post("/encode", json={"inputs": texts[0], "attention": {"layers": [0]}})
        ).json()
        info = (await client.get("/info")).json()
        metrics = (await client.get("/metrics")).text
    assert embed.status_code == 200
    # The server runs with dtype=auto: bfloat16 where this CPU computes it natively.
    auto = resolve_dtype("auto", torch.device("cpu")).name
    assert info["dtype"] == auto and info["dtype_reason"].startswith("auto: ")
    got = np.array(embed.json(), dtype=np.float32)
    want = minilm.embed(texts).numpy()
    cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= (0.99999 if auto == "float32" else 0.999)
    assert len(openai_body["data"][0]["embedding"]) == 384
    assert np.array(encode["data"][0]["attention"][0]["values"]).shape[0] == 12
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert f'embed_model_info{{device="cpu",dtype="{auto}"' in metrics
    assert server.stop() == 0


async def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path, "--shutdown-grace", "60", "--max-batch-inputs", "8", "--max-queue-wait", "60"
    )
    try:
        server.wait_ready()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            in_flight = [
                asyncio.create_task(client.post("/embed", json={"inputs": [LONG_TEXT] * 32}))
                for _ in range(6)
            ]
            await asyncio.sleep(1.0)  # the requests are accepted and the worker is busy
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = await client.get("/health")
            refused = await client.post("/embed", json={"inputs": "too late"})
            finished = await asyncio.gather(*in_flight)
        code = server.process.wait(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert [r.status_code for r in finished] == [200] * 6
    assert all(len(r.json()) == 32 for r in finished)
    assert health.status_code == 503
    assert refused.status_code == 503
    assert refused.json()["error"] == "the server is shutting down"
    assert code == 0


def test_a_model_that_cannot_load_stops_the_process(tmp_path: Path) -> None:
    from tests.helpers import make_random_checkpoint

    folder = tmp_path / "broken"
    make_random_checkpoint(folder)
    (folder / "model.safetensors").write_bytes(b"truncated")
    server = ServerProcess(tmp_path, "--model-id", str(folder))
    try:
        code = server.process.wait(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert code == 1
    assert "model.safetensors: corrupt or truncated" in server.log.read_text()


def test_a_port_in_use_stops_the_process(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """uvicorn stops at once where it cannot bind, with the model still loading in the
    background: the process exits (it waited for ever on the load before)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = subprocess.run(
            [
                sys.executable, "-m", "app", "--model-id", str(tiny_checkpoint),
                "--placement", "in-process", "--host", "127.0.0.1", "--port", str(port),
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert started.returncode != 0
    assert "address already in use" in started.stderr
