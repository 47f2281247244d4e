"""The compose topology without Docker: real replicas, Debian's haproxy and prometheus, the
repository's own configuration files with only their addresses rendered.

Docker gives each replica its own address behind one DNS name (`embed`); here each replica
listens on its own loopback address (127.0.0.2, 127.0.0.3, ... all reach `lo` on Linux) on one
shared port, and a small DNS server answers `embed` with those addresses, so that HAProxy's
`resolvers` and `server-template` run exactly as written. Prometheus's DNS discovery cannot be
pointed at another DNS server, so its targets are rendered as a static list instead.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"
PROMETHEUS_YML = REPO / "deploy" / "prometheus.yml"
ACCESS_LINE = re.compile(r'"POST (/\S*) HTTP/[\d.]+" (\d{3})')
INFERENCE_ROUTES = ("/embed", "/embed_all", "/v1/embeddings", "/encode", "/embeddings", "/")


def free_port(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def port_free_on(port: int, hosts: list[str]) -> bool:
    for host in hosts:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                return False
    return True


def wait_for(what: str, condition: Callable[[], bool], within: float, every: float = 0.2) -> None:
    """Poll until `condition` holds; generous limits, because this machine may be loaded."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"not reached within {within:.0f} s: {what}")


def binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise AssertionError(
            f"{name} is not installed: `make system-deps` installs the Debian packages "
            "that these tests drive"
        )
    return found


# --- DNS ----------------------------------------------------------------------------------


class FakeDNS:
    """Answers A queries for one name with a fixed list of IPv4 addresses (RFC 1035, UDP)."""

    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name.lower().rstrip(".")
        self.addresses = addresses
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-dns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, client = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            answer = self.answer(query)
            if answer is not None:
                self.queries += 1
                self.sock.sendto(answer, client)

    def answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        ident, flags = struct.unpack("!HH", query[:4])
        labels, offset = [], 12
        while offset < len(query) and query[offset] != 0:
            length = query[offset]
            labels.append(query[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
            offset += 1 + length
        offset += 1
        if offset + 4 > len(query):
            return None
        qtype, _qclass = struct.unpack("!HH", query[offset : offset + 4])
        question = query[12 : offset + 4]
        known = ".".join(labels).lower() == self.name
        records = self.addresses if known and qtype == 1 else []
        # QR, the opcode and RD copied, AA, RA; NXDOMAIN for any other name.
        reply_flags = 0x8000 | (flags & 0x7900) | 0x0400 | 0x0080 | (0 if known else 3)
        header = struct.pack("!HHHHHH", ident, reply_flags, 1, len(records), 0, 0)
        body = b"".join(
            struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(address)
            for address in records
        )
        return header + question + body

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=5)


# --- rendering ------------------------------------------------------------------------------


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected {old!r} exactly once in the configuration"
    return text.replace(old, new)


def render_haproxy(*, dns_port: int, lb_port: int, replica_port: int, stats_port: int) -> str:
    """deploy/haproxy.cfg with its four addresses rendered; checks, timeouts, retries as written."""
    text = HAPROXY_CFG.read_text()
    text = replace_once(
        text, "nameserver dns 127.0.0.11:53", f"nameserver dns 127.0.0.1:{dns_port}"
    )
    text = replace_once(text, "bind *:8080", f"bind 127.0.0.1:{lb_port}")
    text = replace_once(text, " embed:8080 ", f" embed:{replica_port} ")
    text = replace_once(
        text, "stats socket ipv4@0.0.0.0:9999", f"stats socket ipv4@127.0.0.1:{stats_port}"
    )
    return text


def render_prometheus(targets: list[str]) -> dict[str, Any]:
    """deploy/prometheus.yml with the DNS discovery of `embed` replaced by the replicas'
    addresses (`host:port`); every other setting of the job as written."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = (j for j in config["scrape_configs"] if j["job_name"] == "embedding-server")
    (discovery,) = job.pop("dns_sd_configs")
    assert discovery["names"] == ["embed"]
    job["static_configs"] = [{"targets": targets}]
    return config


# --- processes ------------------------------------------------------------------------------


@dataclass
class Replica:
    """One service process on its own loopback address; restartable on the same address."""

    host: str
    port: int
    logs: Path
    flags: tuple[str, ...]
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.starts += 1
        self.log = self.logs / f"replica-{self.host}-{self.starts}.log"
        command = [
            sys.executable,
            "-m",
            "app",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.flags,
        ]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def healthy(self) -> bool:
        assert self.process is not None
        assert self.process.poll() is None, f"replica exited:\n{self.log_text()}"
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, within: float = 180.0) -> None:
        wait_for(f"{self.url}/health is 200", self.healthy, within)

    def terminate(self, within: float = 90.0) -> int:
        """SIGTERM, as `docker stop` and the kubelet send it; the exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=within)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def log_text(self) -> str:
        return self.log.read_text() if self.log is not None else ""

    def served(self, route: str = "/embed", status: str = "200") -> float:
        """This replica's own count of `route` answered with `status` (its /metrics)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf'^embed_requests_total\{{route="{re.escape(route)}",status="{status}"\}} (\S+)$'
        match = re.search(pattern, text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def took_traffic(self) -> bool:
        """This process has answered /embed (a restarted process counts from zero)."""
        return self.served() > 0


def inference_log(text: str) -> list[tuple[int, str, int]]:
    """(line number, route, status) of each inference request in a replica's access log."""
    found = []
    for number, line in enumerate(text.splitlines()):
        match = ACCESS_LINE.search(line)
        if match and match.group(1) in INFERENCE_ROUTES:
            found.append((number, match.group(1), int(match.group(2))))
    return found


def line_of(text: str, marker: str) -> int:
    for number, line in enumerate(text.splitlines()):
        if marker in line:
            return number
    raise AssertionError(f"{marker!r} not in the log:\n{text}")


class Daemon:
    """A foreground process (haproxy, prometheus) with its output in a file."""

    def __init__(self, name: str, command: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def check_running(self) -> None:
        code = self.process.poll()
        assert code is None, f"{self.name} exited with {code}:\n{self.log.read_text()}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)


class HAProxyAdmin:
    """HAProxy's runtime API over its TCP stats socket (one command per connection)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def command(self, line: str) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as conn:
            conn.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self, backend: str = "embed") -> dict[str, dict[str, str]]:
        """`show servers state`, keyed by server name; only servers with an address."""
        lines = self.command(f"show servers state {backend}").splitlines()
        header = next(line for line in lines if line.startswith("# be_id"))
        names = header[2:].split()
        rows = [dict(zip(names, line.split(), strict=False)) for line in lines[2:] if line]
        return {row["srv_name"]: row for row in rows if row.get("srv_addr") not in ("0.0.0.0", "-")}

    def server_for(self, host: str) -> str:
        for name, row in self.servers().items():
            if row["srv_addr"] == host:
                return name
        raise AssertionError(f"HAProxy has no server at {host}: {self.servers()}")

    def up(self, host: str) -> bool:
        # srv_op_state 2 is SRV_ST_RUNNING; srv_admin_state 0 is no maintenance or drain.
        rows = [row for row in self.servers().values() if row["srv_addr"] == host]
        return bool(rows) and rows[0]["srv_op_state"] == "2"

    def down(self, host: str) -> bool:
        return not self.up(host)

    def sessions(self, server: str, backend: str = "embed") -> int:
        """Requests in flight to `server` (the `scur` column of `show stat`)."""
        lines = self.command("show stat").splitlines()
        columns = lines[0].lstrip("# ").split(",")
        for line in lines[1:]:
            row = dict(zip(columns, line.split(","), strict=False))
            if row.get("pxname") == backend and row.get("svname") == server:
                return int(row["scur"] or 0)
        raise AssertionError(f"no server {backend}/{server} in `show stat`")


# --- load -------------------------------------------------------------------------------------


@dataclass
class Load:
    """Clients sending /embed through the load balancer without pause, each result checked."""

    url: str
    clients: int = 3
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, number: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            sent = 0
            while not self._stop.is_set():
                sent += 1
                text = f"client {number} sentence {sent} about load balancing"
                try:
                    response = client.post("/embed", json={"inputs": [text]})
                    good = response.status_code == 200 and len(response.json()[0]) == 384
                    problem = "" if good else f"{response.status_code} {response.text[:200]}"
                except httpx.HTTPError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if problem:
                        self.failures.append(problem)
                    else:
                        self.ok += 1

    def __enter__(self) -> Load:
        for number in range(self.clients):
            thread = threading.Thread(target=self._client, args=(number,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
