"""Readiness, draining and settings: what load balancers and operators rely on."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.__main__ import load_settings
from app.main import create_app
from app.settings import Settings
from app.stop_signal import SUPERVISOR_STOP
from app.supervisor import Supervisor, bind, reserve
from tests.app.conftest import GatedForward, make_settings, running_app, service_of

pytestmark = pytest.mark.anyio


async def test_health_is_503_until_loaded_and_live_never_waits(tiny_checkpoint: Path) -> None:
    import httpx

    app = create_app(make_settings(tiny_checkpoint))
    service = service_of(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        # Before the lifespan runs nothing is loaded: not ready, yet alive.
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"error": "the model is loading", "error_type": "Unhealthy"}
        assert (await client.get("/live")).status_code == 200
        assert (await client.post("/embed", json={"inputs": "a"})).status_code == 503
        async with app.router.lifespan_context(app):
            for _ in range(300):
                if service.ready:
                    break
                await asyncio.sleep(0.01)
            assert (await client.get("/health")).status_code == 200


async def test_a_model_that_cannot_load_keeps_health_503(tmp_path: Path) -> None:
    import httpx

    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    reasons: list[str] = []
    app = create_app(make_settings(tmp_path), on_fatal=reasons.append)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        for _ in range(300):
            if reasons:
                break
            await asyncio.sleep(0.01)
        health = await client.get("/health")
    assert reasons and "missing key 'vocab_size'" in reasons[0]
    assert health.status_code == 503
    assert "failed to load" in health.json()["error"]


async def test_drain_refuses_new_work_and_finishes_accepted_work(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        service = service_of(app)
        gate = GatedForward(service)
        gate.gate.clear()
        accepted = [
            asyncio.create_task(client.post("/embed", json={"inputs": f"hello {i}"}))
            for i in range(3)
        ]
        await asyncio.to_thread(gate.entered.wait, 10)
        service.begin_drain()
        health = await client.get("/health")
        refused = await client.post("/embed", json={"inputs": "new work"})
        idle = asyncio.create_task(service.wait_idle(10))
        await asyncio.sleep(0.05)
        assert not idle.done()  # accepted requests are still running
        gate.gate.set()
        finished = await asyncio.gather(*accepted)
        assert await idle
    assert health.status_code == 503 and health.json()["error"] == "the server is shutting down"
    assert refused.status_code == 503
    assert [r.status_code for r in finished] == [200, 200, 200]


async def test_drain_gives_up_after_the_grace_period(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        service = service_of(app)
        gate = GatedForward(service)
        held = await gate.hold(client)
        service.begin_drain()
        assert await service.wait_idle(0.1) is False
        gate.gate.set()
        await held


def test_settings_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBED_MAX_BATCH_TOKENS", "999")
    monkeypatch.setenv("EMBED_CORS_ORIGINS", "https://a.example,https://b.example")
    settings = load_settings(
        [
            "--port",
            "9000",
            "--devices",
            "cuda:1",
            "--no-auto-truncate",
            "--api-key",
            "k",
            "--log-format",
            "json",
            "--no-cuda-graphs",
            "--no-prepack",
        ]
    )
    assert settings.port == 9000 and settings.devices == ["cuda:1"]
    assert settings.cuda_graphs is False and Settings().cuda_graphs is True
    assert settings.prepack is False and Settings().prepack is True
    assert settings.auto_truncate is False and settings.max_batch_tokens == 999
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k"
    assert settings.cors_origins == ["https://a.example", "https://b.example"]
    assert Settings().host == "0.0.0.0" and Settings().port == 8080


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--port", "70000"], "port"),
        (["--devices", "tpu"], "devices"),
        (["--dtype", "float8"], "dtype"),
        (["--max-batch-tokens", "0"], "max_batch_tokens"),
        (["--request-timeout", "-1"], "request_timeout"),
        (["--log-format", "xml"], "log_format"),
    ],
)
def test_bad_setting_stops_start_up_naming_it(argv: list[str], named: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        load_settings(argv)
    assert named in str(stopped.value)


def test_unknown_model_stops_start_up_before_binding(capsys: pytest.CaptureFixture[str]) -> None:
    from app.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["--model-id", "nobody/nothing", "--devices", "cpu"])
    assert "nobody/nothing" in str(stopped.value)


def test_auto_without_a_gpu_driver_is_the_cpu_without_a_child(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The child that imports torch to find `auto` runs only where a GPU driver is there."""
    import app.__main__ as entry

    asked: list[list[str]] = []

    def child(devices: list[str]) -> list[str]:
        asked.append(devices)
        return ["cuda"]

    monkeypatch.setattr(entry, "resolve_devices_in_child", child)
    monkeypatch.setattr(entry, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    on_cpu = entry.placed(Settings(devices=["auto"]))
    assert asked == [] and set(on_cpu.devices) == {"cpu"}
    assert entry.placed(Settings(devices=["cpu", "cpu"])).devices == ["cpu", "cpu"]
    (tmp_path / "nvidiactl").touch()  # a driver's file: only torch can say whether CUDA works
    assert entry.placed(Settings(devices=["auto"])).devices == ["cuda"]
    assert asked == [["auto"]]


def test_a_port_held_for_a_server_s_front_ends_is_refused_to_another_server() -> None:
    """While a split server's engines load, its port is held by a socket that never listens:
    another server's check must fail on it (two sockets with SO_REUSEADDR, neither
    listening, may share a port), and the server's own front ends must still bind."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings(model_id="m", host="127.0.0.1", port=port)
    held = reserve(settings)
    try:
        with pytest.raises(OSError):
            reserve(settings).close()
        bind(settings, listen=True).close()  # a front end of the server holding it
    finally:
        held.close()
    reserve(settings).close()  # free again


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_reaches_the_children_as_the_supervisors_stop(
    sig: signal.Signals, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT (Ctrl-C) too: a front end still starting dies of SUPERVISOR_STOP quietly,
    counted as stopped while it started, where SIGINT raised KeyboardInterrupt in its imports
    (exit 1). One that has exited but is not yet reaped is passed over. A second signal is
    passed on too (the front ends then exit at once), and the supervisor's exit says it."""
    sent: list[tuple[int, int]] = []

    def kill(pid: int, signal_number: int) -> None:
        if pid == 3:
            raise ProcessLookupError
        sent.append((pid, signal_number))

    monkeypatch.setattr(os, "kill", kill)
    supervisor = Supervisor(Settings(model_id="m"), multiprocessing.get_context("spawn"), None)  # type: ignore[arg-type]
    children = [SimpleNamespace(pid=pid, exitcode=None) for pid in (2, 3, 4)]
    supervisor.frontends = children  # type: ignore[assignment]
    supervisor._forward(sig, None)
    assert supervisor.stopping.is_set() and supervisor.code == 0
    assert sent == [(2, SUPERVISOR_STOP), (4, SUPERVISOR_STOP)]
    supervisor._forward(sig, None)
    assert sent[2:] == [(2, SUPERVISOR_STOP), (4, SUPERVISOR_STOP)]
    assert supervisor.code == 128 + sig
