"""docker-compose.yml and the files it mounts agree with each other and with the service.

test_compose_topology.py runs the mounted files for real; these checks cover what only the
compose file says (the names, ports and grace periods that tie the three services together).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from app.settings import Settings
from tests.deploy.topology import HAPROXY_CFG, PROMETHEUS_YML

REPO = Path(__file__).resolve().parents[2]
EXIT_MARGIN = 5  # seconds to exit after the drain (see test_kubernetes.py)


def compose() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return config


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert match, duration
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def haproxy_directive(name: str) -> list[str]:
    """The arguments of every line of deploy/haproxy.cfg that starts with `name`."""
    found = []
    for line in HAPROXY_CFG.read_text().splitlines():
        stripped = line.split("#", 1)[0].strip()
        if stripped.startswith(name + " "):
            found.append(stripped[len(name) :].strip())
    return found


def service_setting(name: str) -> float:
    environment = compose()["services"]["embed"]["environment"]
    value = environment.get(f"EMBED_{name.upper()}", Settings.model_fields[name].default)
    return float(value)


def test_compose_mounts_the_files_that_deploy_test_runs() -> None:
    services = compose()["services"]
    mounts = services["loadbalancer"]["volumes"] + services["prometheus"]["volumes"]
    sources = {(REPO / mount.split(":")[0]).resolve() for mount in mounts}
    assert sources == {HAPROXY_CFG.resolve(), PROMETHEUS_YML.resolve()}


def test_the_replicas_are_found_by_their_service_name_and_port() -> None:
    services = compose()["services"]
    port = str(Settings.model_fields["port"].default)
    assert services["embed"]["expose"] == [port]
    (template,) = haproxy_directive("server-template")
    assert f" embed:{port} " in f" {template} "
    (job,) = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    (discovery,) = job["dns_sd_configs"]
    assert (discovery["names"], str(discovery["port"])) == (["embed"], port)
    assert services["embed"]["deploy"]["replicas"] >= 2


def test_stop_grace_period_covers_the_drain() -> None:
    embed = compose()["services"]["embed"]
    grace = service_setting("drain_delay") + service_setting("shutdown_grace")
    assert seconds(embed["stop_grace_period"]) >= grace + EXIT_MARGIN
    assert service_setting("request_timeout") <= grace


def test_haproxy_waits_longer_than_the_service_and_retries_only_what_is_safe() -> None:
    (timeout_server,) = [t for t in haproxy_directive("timeout") if t.startswith("server ")]
    # The service answers a slow request itself (504) before HAProxy would cut it off.
    assert seconds(timeout_server.split()[1]) > service_setting("request_timeout")
    (retry_on,) = haproxy_directive("retry-on")
    retried = set(retry_on.split())
    assert "503" in retried  # not ready, draining, over the connection limit: nothing ran
    # 500 (the forward pass failed) and 504 (the work may have run) are never retried.
    assert retried.isdisjoint({"500", "504", "all-retryable-errors", "response-timeout"})
    # Without it HAProxy never retries a request whose body came after its headers.
    assert "http-buffer-request" in haproxy_directive("option")
    (check,) = haproxy_directive("option httpchk")
    assert check == "GET /health"


def test_haproxy_keeps_each_replica_under_its_connection_limit() -> None:
    (server,) = haproxy_directive("default-server")
    words = server.split()
    per_replica = int(words[words.index("maxconn") + 1])
    # The service's own limit on requests in progress (its fast 429 is not retried) and its
    # connection limit (uvicorn's 503, which would also fail HAProxy's /health checks).
    assert per_replica <= int(Settings.model_fields["max_concurrent_requests"].default)
    assert per_replica <= int(Settings.model_fields["max_connections"].default) // 2
    (queue,) = [t for t in haproxy_directive("timeout") if t.startswith("queue ")]
    assert seconds(queue.split()[1]) >= service_setting("request_timeout")
