"""Operating the server: the stop sequence, the concurrency limit, threads, dtype choice and
prepacked weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from app import settings as settings_module
from app.settings import Settings
from model import prepacked
from model.cpus import available_cpus
from model.device import cpu_flags, cpu_vendor, resolve_dtype
from tests.app.conftest import GatedForward, local_engine, make_settings, running_app, service_of

pytestmark = pytest.mark.anyio


async def test_stop_signal_turns_health_503_before_refusing_work(tiny_checkpoint: Path) -> None:
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        service = service_of(app)
        service.begin_stop()  # the first moments after SIGTERM (drain_delay)
        health = await client.get("/health")
        served = await client.post("/embed", json={"inputs": "hello"})
        service.begin_drain()
        refused = await client.post("/embed", json={"inputs": "hello"})
        live = await client.get("/live")
    assert health.status_code == 503 and served.status_code == 200
    assert refused.status_code == 503 and live.status_code == 200


async def test_requests_in_progress_are_bounded_but_probes_are_not(tiny_checkpoint: Path) -> None:
    settings = make_settings(tiny_checkpoint, max_concurrent_requests=1)
    async with running_app(settings) as (app, client):
        gate = GatedForward(service_of(app))
        held = await gate.hold(client)
        refused = await client.post("/embed", json={"inputs": "world"})
        probes = [await client.get(path) for path in ("/health", "/live", "/ping", "/metrics")]
        gate.gate.set()
        first = await held
        after = await client.post("/embed", json={"inputs": "world"})
    assert first.status_code == 200 and after.status_code == 200
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "the limit of this server" in refused.json()["error"]
    assert [p.status_code for p in probes] == [200] * 4


async def test_a_wrong_key_is_a_401_however_busy_the_server_is(tiny_checkpoint: Path) -> None:
    """The key is checked before the limit on requests in progress: a client with a wrong key
    learns that, not that it should retry."""
    settings = make_settings(tiny_checkpoint, max_concurrent_requests=1, api_key="s3cret")
    async with running_app(settings) as (app, client):
        client.headers["authorization"] = "Bearer s3cret"
        gate = GatedForward(service_of(app))
        held = await gate.hold(client)
        wrong_key = {"authorization": "Bearer wrong"}
        wrong = await client.post("/embed", json={"inputs": "world"}, headers=wrong_key)
        busy = await client.post("/embed", json={"inputs": "world"})
        gate.gate.set()
        first = await held
    assert first.status_code == 200
    assert wrong.status_code == 401 and busy.status_code == 429


def test_threads_follow_the_cgroup_quota(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # --cpus 1.5
    assert available_cpus(cpu_max) == min(2, available_cpus(tmp_path / "absent"))
    cpu_max.write_text("max 100000\n")
    assert available_cpus(cpu_max) == available_cpus(tmp_path / "absent")


def test_more_torch_threads_than_cpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 2)
    base = Settings(model_id="m")
    two_engines = {"devices": ["cpu", "cpu"]}
    assert base.model_copy(update=two_engines).cpu_oversubscription() is None  # 1 each
    assert base.model_copy(update={"threads": 2}).cpu_oversubscription() is None
    crowded = base.model_copy(update={**two_engines, "threads": 2}).cpu_oversubscription()
    assert crowded is not None
    assert "2 engine(s) x 2 torch threads" in crowded and "2 CPUs" in crowded


def test_auto_runs_what_measured_best_where_it_finds_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 2)
    auto = Settings(model_id="m")
    two = auto.placed_on(["cpu"])
    assert two.devices == ["cpu", "cpu"] and two.split() and two.frontend_count() == 2
    assert two.engine_threads() == 1
    assert auto.placed_on(["cuda"]).devices == ["cuda"] and auto.placed_on(["cuda"]).split()
    # One engine where asked for one process, where threads leave no room, on one CPU.
    assert Settings(model_id="m", placement="in-process").placed_on(["cpu"]).devices == ["cpu"]
    assert Settings(model_id="m", threads=2).placed_on(["cpu"]).devices == ["cpu"]
    monkeypatch.setattr(settings_module, "available_cpus", lambda: 1)
    assert not auto.placed_on(["cpu"]).split()
    # Named devices are kept as they are.
    assert Settings(model_id="m", devices="cpu").placed_on(["cpu"]).devices == ["cpu"]


def test_the_batch_wait_is_chosen_per_device_unless_set() -> None:
    """A fuller batch is worth waiting for on a CPU, not on a GPU (docs/benchmarks.md)."""
    auto = Settings(model_id="m")
    assert auto.batch_wait("cpu") == 0.05
    assert auto.batch_wait("cuda:0") == 0.0
    chosen = Settings(model_id="m", batch_wait_ms=5)
    assert chosen.batch_wait("cpu") == chosen.batch_wait("cuda") == 0.005
    assert Settings(model_id="m", batch_wait_ms=0).batch_wait("cpu") == 0.0


def test_one_process_cannot_hold_several_engines() -> None:
    with pytest.raises(ValueError, match="placement in-process runs one engine"):
        Settings(model_id="m", placement="in-process", devices="cpu,cpu")


async def test_a_cpu_server_on_more_threads_than_cpus_says_so_at_start(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(tiny_checkpoint, threads=available_cpus() + 1)
    with caplog.at_level(logging.WARNING, logger="app.service"):
        async with running_app(settings) as (_, client):
            assert (await client.post("/embed", json={"inputs": "hello"})).status_code == 200
    assert "forward passes will stall each other" in caplog.text


@pytest.mark.parametrize("prepack", [True, False])
async def test_the_prepack_setting_reaches_the_model(
    tiny_checkpoint: Path,
    prepack: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On by default: a CPU server's linear layers run prepacked (model/prepacked.py; the
    tiny model's too, which alone are too small to gain), and the log names the kernel."""
    monkeypatch.setattr(prepacked, "MIN_MKL_WEIGHTS", 0)
    monkeypatch.setattr(prepacked, "MIN_ONEDNN_FLOAT32_WEIGHTS", 0)
    kernel = "MklLinear" if prepacked.mkl_packs_float32() else "OnednnLinear"
    with caplog.at_level(logging.INFO, logger="app.engine.model_engine"):
        async with running_app(make_settings(tiny_checkpoint, prepack=prepack)) as (app, client):
            embedder = local_engine(app).model.embedder
            assert embedder is not None and (embedder.prepacked > 0) is prepack
            assert (await client.post("/embed", json={"inputs": "hello"})).status_code == 200
    assert (f"linear layers prepacked ({kernel})" in caplog.text) is prepack


def test_auto_dtype_takes_bfloat16_only_where_the_cpu_computes_it() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, frozenset({"avx512f", "avx512_bf16"})).name == "bfloat16"
    amx = resolve_dtype("auto", cpu, frozenset({"amx_bf16"}))
    assert amx.name == "bfloat16" and "amx_bf16" in amx.reason
    plain = resolve_dtype("auto", cpu, frozenset({"avx2", "avx512f"}))
    assert plain.name == "float32" and plain.reason.startswith("auto:")
    assert resolve_dtype("float32", cpu, frozenset({"amx_bf16"})).name == "float32"


def test_the_cpu_read_from_proc_cpuinfo(tmp_path: Path) -> None:
    """The first processor's flags and vendor (which pick the dtype and the float32 kernel);
    nothing where the file is missing."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f amx_bf16\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n"
    )
    assert cpu_vendor(cpuinfo) == "GenuineIntel"
    assert cpu_flags(cpuinfo) == {"fpu", "avx512f", "amx_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert cpu_flags(arm) == {"fp", "asimd"} and cpu_vendor(arm) == ""
    assert cpu_flags(tmp_path / "missing") == frozenset() and cpu_vendor(tmp_path / "x") == ""


async def test_probes_answer_503_without_counting_failed_requests(tiny_checkpoint: Path) -> None:
    """A readiness 503 is the probe's answer: counting it in embed_failures_total would raise
    the failure rate at every start-up and drain."""
    async with running_app(make_settings(tiny_checkpoint)) as (app, client):
        service_of(app).begin_stop()
        probes = [await client.get(path) for path in ("/health", "/ping")]
        accepted = await client.post("/embed", json={"inputs": "hello"})  # drain_delay
        service_of(app).begin_drain()
        drained = await client.post("/embed", json={"inputs": "hello"})
        metrics = (await client.get("/metrics")).text
    assert [probe.status_code for probe in probes] == [503, 503]
    assert probes[0].json() == {"error": "the server is shutting down", "error_type": "Unhealthy"}
    assert accepted.status_code == 200 and drained.status_code == 503
    # The one refused request counts; the probes (and start-up's polling) do not.
    assert 'embed_failures_total{reason="Unhealthy"} 1.0' in metrics


async def test_cors_headers_on_every_answer(tiny_checkpoint: Path) -> None:
    """The fast path and the errors the service middleware writes itself carry them too."""
    origin = "https://a.example"
    settings = make_settings(
        tiny_checkpoint, cors_origins=[origin], api_key="s3cret", payload_limit=4096
    )
    allowed = {"authorization": "Bearer s3cret", "origin": origin}
    async with running_app(settings) as (_, client):
        answers = [
            await client.post("/embed", json={"inputs": "hi"}, headers=allowed),
            await client.post("/v1/embeddings", json={"input": "hi"}, headers=allowed),
            await client.post("/embed", json={"inputs": "hi", "dimensions": 999}, headers=allowed),
            await client.post("/embed", json={"inputs": "hi"}, headers={"origin": origin}),
            await client.post(
                "/embed",
                content=b"x" * 5000,
                headers={**allowed, "content-type": "application/json"},
            ),
            await client.get("/health", headers={"origin": origin}),
        ]
        preflight = await client.options(
            "/embed", headers={"origin": origin, "access-control-request-method": "POST"}
        )
        stranger = await client.post(
            "/embed", json={"inputs": "hi"}, headers={**allowed, "origin": "https://b.example"}
        )
    assert [answer.status_code for answer in answers] == [200, 200, 422, 401, 413, 200]
    assert [answer.headers.get("access-control-allow-origin") for answer in answers] == [
        origin
    ] * len(answers)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "access-control-allow-origin" not in stranger.headers
