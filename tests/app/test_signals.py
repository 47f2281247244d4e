"""A second SIGTERM during a drain ends the real server process at once (128 + 15)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.app.test_server_process import LONG_TEXT, ServerProcess

pytestmark = pytest.mark.anyio


async def test_a_second_sigterm_during_the_drain_exits_at_once(tmp_path: Path) -> None:
    # A minute of grace: the first signal alone would wait for the work in flight.
    server = ServerProcess(tmp_path, "--shutdown-grace", "60", "--max-batch-inputs", "8")
    try:
        server.wait_ready()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            # Tens of seconds of work on two threads: far more than the test waits.
            in_flight = [
                asyncio.create_task(client.post("/embed", json={"inputs": [LONG_TEXT] * 64}))
                for _ in range(8)
            ]
            await asyncio.sleep(1.0)  # accepted, and the worker is busy
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            draining = await client.get("/health")
            server.process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(server.process.wait, 30)
            outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    assert draining.status_code == 503  # the first signal started the drain
    assert code == 128 + signal.SIGTERM
    # It did not wait for the drain: requests still in flight were cut off.
    assert any(isinstance(outcome, httpx.TransportError) for outcome in outcomes)
    assert "second signal during the drain: exiting now" in server.log.read_text()
