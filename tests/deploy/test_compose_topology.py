"""docker-compose.yml's topology without Docker (`make deploy-test`; CI runs it with the rest).

Two real service processes (the default model, one thread each) behind Debian's haproxy with
deploy/haproxy.cfg, scraped by Debian's prometheus with deploy/prometheus.yml; the files'
addresses are rendered and nothing else (tests/deploy/topology.py). No assertion depends on
timing: every wait polls for a state, with limits generous enough for a loaded 2-core machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import httpx
import pytest
import yaml

from tests.deploy.topology import (
    HAPROXY_CFG,
    PROMETHEUS_YML,
    Daemon,
    FakeDNS,
    HAProxyAdmin,
    Load,
    Replica,
    binary,
    free_port,
    inference_log,
    line_of,
    port_free_on,
    render_haproxy,
    render_prometheus,
    wait_for,
)

HOSTS = ["127.0.0.2", "127.0.0.3"]
REPLICA_FLAGS = ("--devices", "cpu", "--threads", "1", "--shutdown-grace", "20", "--access-log")
READY_LINE = "app.engine.model_engine: ready:"
DRAIN_LINE = "app.service: draining:"


@dataclass
class Topology:
    replicas: list[Replica]
    lb_url: str
    admin: HAProxyAdmin
    prometheus_url: str
    haproxy: Daemon
    prometheus: Daemon


def shared_free_port() -> int:
    """A port free on every replica address, so that all replicas listen on the same one."""
    for _ in range(50):
        port = free_port()
        if port_free_on(port, HOSTS):
            return port
    raise AssertionError("no port free on every replica address")


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    work = tmp_path_factory.mktemp("topology")
    port = shared_free_port()
    lb_port, stats_port, prometheus_port = free_port(), free_port(), free_port()
    dns = FakeDNS("embed", HOSTS)
    replicas = [Replica(host, port, work, REPLICA_FLAGS) for host in HOSTS]
    haproxy_cfg = work / "haproxy.cfg"
    haproxy_cfg.write_text(
        render_haproxy(dns_port=dns.port, lb_port=lb_port, replica_port=port, stats_port=stats_port)
    )
    prometheus_yml = work / "prometheus.yml"
    prometheus_yml.write_text(
        yaml.safe_dump(render_prometheus([f"{host}:{port}" for host in HOSTS]))
    )
    daemons: list[Daemon] = []
    try:
        for replica in replicas:
            replica.start()
        # Started with the replicas, as compose starts them: HAProxy must hold traffic back
        # from replicas that are still loading.
        daemons.append(
            Daemon("haproxy", [binary("haproxy"), "-db", "-f", str(haproxy_cfg)], work / "lb.log")
        )
        daemons.append(
            Daemon(
                "prometheus",
                [
                    binary("prometheus"),
                    f"--config.file={prometheus_yml}",
                    f"--storage.tsdb.path={work / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prometheus_port}",
                ],
                work / "prometheus.log",
            )
        )
        admin = HAProxyAdmin(stats_port)
        for replica in replicas:
            replica.wait_healthy()
        for replica in replicas:
            wait_for(f"HAProxy routes to {replica.host}", partial(admin.up, replica.host), 60)
        yield Topology(
            replicas=replicas,
            lb_url=f"http://127.0.0.1:{lb_port}",
            admin=admin,
            prometheus_url=f"http://127.0.0.1:{prometheus_port}",
            haproxy=daemons[0],
            prometheus=daemons[1],
        )
    finally:
        for replica in replicas:
            replica.kill()
        for daemon in daemons:
            daemon.stop()
        dns.close()


def assert_no_refusals(replica: Replica, when: str) -> None:
    """A replica that answered no inference request with 503 never got one while loading or
    draining: both refuse with 503 before anything runs."""
    refused = [entry for entry in inference_log(replica.log_text()) if entry[2] == 503]
    assert refused == [], f"{replica.host} {when} got requests it refused:\n{replica.log_text()}"


def test_the_shipped_files_are_valid() -> None:
    check = subprocess.run(
        [binary("haproxy"), "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    check = subprocess.run(
        [binary("promtool"), "check", "config", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_rendering_changes_only_addresses() -> None:
    original = HAPROXY_CFG.read_text().splitlines()
    rendered = render_haproxy(
        dns_port=5353, lb_port=18080, replica_port=18081, stats_port=19999
    ).splitlines()
    changed = [(a, b) for a, b in zip(original, rendered, strict=True) if a != b]
    assert len(changed) == 4
    for before, after in changed:
        assert before.split()[0] == after.split()[0]  # same directive, other address
    config = render_prometheus(["127.0.0.2:18081", "127.0.0.3:18081"])
    (job,) = config["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["127.0.0.2:18081", "127.0.0.3:18081"]}]
    assert "dns_sd_configs" not in job
    original_job = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"][0]
    assert {k: v for k, v in original_job.items() if k != "dns_sd_configs"} == {
        k: v for k, v in job.items() if k != "static_configs"
    }


def test_requests_are_spread_over_both_replicas(topology: Topology) -> None:
    before = [replica.served() for replica in topology.replicas]
    with Load(topology.lb_url) as load:
        wait_for(
            "every replica answered at least 10 more requests (its own /metrics)",
            lambda: all(
                replica.served() >= count + 10
                for replica, count in zip(topology.replicas, before, strict=True)
            ),
            within=120,
        )
    assert load.failures == [], topology.haproxy.log.read_text()[-4000:]


def test_rolling_restart_under_load_fails_no_request(topology: Topology) -> None:
    """Each replica in turn gets SIGTERM (what `docker stop` sends), drains, exits 0 and comes
    back; no client sees a failure, and a replica takes traffic only once /health is 200."""
    refused_while_draining = {}
    with Load(topology.lb_url) as load:
        for replica in topology.replicas:
            old = replica
            assert old.terminate() == 0
            old_log = old.log_text()
            line_of(old_log, DRAIN_LINE)
            # Until HAProxy's next check sees /health 503, a draining replica still gets
            # requests; it refuses them with 503 before anything runs and HAProxy sends them
            # to the other replica (retry-on 503, redispatch). Counted, not asserted.
            refused_while_draining[replica.host] = sum(
                1 for _, _, status in inference_log(old_log) if status == 503
            )
            wait_for(
                f"HAProxy took {replica.host} out",
                partial(topology.admin.down, replica.host),
                60,
            )
            replica.start()
            replica.wait_healthy()
            wait_for(f"{replica.host} takes traffic again", replica.took_traffic, 60)
            new_log = replica.log_text()
            first_inference = inference_log(new_log)[0][0]
            assert first_inference > line_of(new_log, READY_LINE)
            assert_no_refusals(replica, "while loading")
        sent_during_restart = load.ok
    print(f"requests answered during the rolling restart: {sent_during_restart}")
    print(f"requests refused by a draining replica and retried elsewhere: {refused_while_draining}")
    assert load.failures == [], topology.haproxy.log.read_text()[-4000:]
    assert load.ok > 0


def test_a_replica_drained_in_haproxy_first_receives_no_new_request(topology: Topology) -> None:
    """The planned restart (haproxy.cfg's runtime API): drain in HAProxy, wait for its sessions
    to end, then SIGTERM. The draining and the loading process get no request at all."""
    replica = topology.replicas[0]
    admin = topology.admin
    with Load(topology.lb_url) as load:
        wait_for(f"{replica.host} serves", replica.took_traffic, 60)
        server = admin.server_for(replica.host)
        admin.command(f"set server embed/{server} state drain")
        wait_for(f"no request in flight to {server}", lambda: admin.sessions(server) == 0, 60)
        assert replica.terminate() == 0
        line_of(replica.log_text(), DRAIN_LINE)
        assert_no_refusals(replica, "while draining")
        replica.start()
        admin.command(f"set server embed/{server} state ready")
        replica.wait_healthy()
        wait_for(f"{replica.host} takes traffic again", replica.took_traffic, 60)
        assert_no_refusals(replica, "while loading")
    assert load.failures == [], topology.haproxy.log.read_text()[-4000:]


def test_prometheus_scrapes_both_replicas(topology: Topology) -> None:
    expected = {f"{replica.host}:{replica.port}" for replica in topology.replicas}
    api = f"{topology.prometheus_url}/api/v1"

    def targets_up() -> bool:
        topology.prometheus.check_running()
        try:
            targets = httpx.get(f"{api}/targets", timeout=10).json()["data"]["activeTargets"]
        except httpx.TransportError:
            return False
        up = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
        return up == expected and len(targets) == len(expected)

    # The scrape interval is 15 s, and a restarted replica may have missed a scrape.
    wait_for("Prometheus has both replicas up", targets_up, within=120, every=1)

    def series_by_instance() -> dict[str, float]:
        query = 'count by (instance) ({__name__=~"embed_.+", job="embedding-server"})'
        body = httpx.get(f"{api}/query", params={"query": query}, timeout=10).json()
        return {r["metric"]["instance"]: float(r["value"][1]) for r in body["data"]["result"]}

    wait_for("embed_ series for both replicas", lambda: set(series_by_instance()) == expected, 60)
    counts = series_by_instance()
    assert all(count >= 10 for count in counts.values()), counts
    queue = httpx.get(f"{api}/query", params={"query": "embed_queue_depth"}, timeout=10).json()
    assert {r["metric"]["instance"] for r in queue["data"]["result"]} == expected
