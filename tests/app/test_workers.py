"""--workers: several server processes on one port, metrics summed, one stop for all."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.balance import ConnectionBalance
from tests.app.test_server_process import ServerProcess

pytestmark = pytest.mark.slow


def workers_of(supervisor: int) -> list[int]:
    """The supervisor's worker processes (its other child is multiprocessing's tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == supervisor and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def requests_counted(url: str) -> float:
    # A fresh connection per scrape, so that the scrapes reach either worker.
    text = httpx.get(f"{url}/metrics", headers={"Connection": "close"}).text
    match = re.search(r'^embed_requests_total\{route="/embed",status="200"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def workers(tmp_path: Path, tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tmp_path, "--model-id", str(tiny_checkpoint), "--workers", "2", "--threads", "1",
        "--access-log", "--max-batch-inputs", "1",
    )  # fmt: skip
    try:
        server.wait_ready()
        # /health answers once one worker is ready; wait for the other too.
        deadline = time.monotonic() + 60
        while server.log.read_text().count("ready: ") < 2:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.2)
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_workers_share_the_port_and_metrics_sum_over_them(workers: ServerProcess) -> None:
    pids = workers_of(workers.process.pid)
    assert len(pids) == 2
    answered_by: set[str] = set()
    sent = 0
    # New connections until both workers have answered one (the kernel picks the acceptor).
    while len(answered_by) < 2 and sent < 300:
        response = httpx.post(
            f"{workers.url}/embed", json={"inputs": f"text {sent}"}, headers={"Connection": "close"}
        )
        assert response.status_code == 200
        sent += 1
        answered_by = set(
            re.findall(r" (\d+) INFO uvicorn.access: .*POST /embed", workers.log.read_text())
        )
    assert answered_by == {str(pid) for pid in pids}
    # Whichever worker answers the scrape reports both workers' requests.
    assert [requests_counted(workers.url) for _ in range(6)] == [float(sent)] * 6
    text = httpx.get(f"{workers.url}/metrics").text
    assert len(re.findall(r"^embed_model_info\{.*\} 1\.0$", text, re.M)) == 1
    # Each request came alone, with the other worker idle: each pass ran on both cores.
    passes = dict(re.findall(r'^embed_forward_passes_total\{threads="(\d+)"\} (\S+)$', text, re.M))
    assert passes == {"2": f"{float(sent)}"}


def queue_depth(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Connection": "close"}).text
    match = re.search(r"^embed_queue_depth (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def test_the_queue_gauge_sums_the_workers_queues(workers: ServerProcess) -> None:
    # One input per forward pass: a request of 2,000 keeps one worker's queue busy a while.
    with ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(
            httpx.post, f"{workers.url}/embed", json={"inputs": ["a b c"] * 2000}, timeout=120
        )
        depths = []
        while not long_request.done():
            depths.append(queue_depth(workers.url))
        assert long_request.result().status_code == 200
    # Seen from either worker (a fresh connection per scrape), and empty again at the end.
    assert max(depths) > 0
    assert queue_depth(workers.url) == 0


def shared_weights_of(pid: int) -> set[tuple[str, str]]:
    """The weight stores a process maps (model/shared_weights.py): path, permissions."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {(f[5], f[1]) for f in map(str.split, maps) if len(f) >= 6 and "embed-weights-" in f[5]}


def test_a_signal_drains_every_worker_and_removes_the_metrics_and_weights_files(
    workers: ServerProcess,
) -> None:
    pids = workers_of(workers.process.pid)
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    metrics_dir = Path(
        next(v for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
        .split(b"=", 1)[1]
        .decode()
    )
    assert metrics_dir.is_dir()
    # Both workers read their weights from one file, mapped read-only and shared.
    (store, permissions), *others = shared_weights_of(pids[0])
    assert not others and shared_weights_of(pids[1]) == {(store, permissions)}
    assert permissions == "r--s" and store.endswith("weights.bin")
    assert workers.stop() == 0
    assert not any(alive(pid) for pid in pids)
    assert not metrics_dir.exists()
    assert not Path(store).parent.exists()
    assert workers.log.read_text().count("Finished server process") == 2


def libraries_of(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(f[5]).name for f in map(str.split, maps) if len(f) >= 6}


def test_the_supervisor_never_imports_torch(workers: ServerProcess) -> None:
    """It only spawns and watches: torch would cost it about 165 MiB (model/__init__.py)."""
    first, _ = workers_of(workers.process.pid)
    assert "libtorch_cpu.so" in libraries_of(first)
    assert not any(name.startswith("libtorch") for name in libraries_of(workers.process.pid))


def test_a_device_that_cannot_work_stops_the_supervisor_with_the_reason(
    tiny_checkpoint: Path,
) -> None:
    """Checked in a child process (the supervisor has no torch), with the same message as
    one server gives; no GPU is visible to it here, whatever the machine has."""
    messages = []
    for workers in ("1", "2"):
        started = subprocess.run(
            [
                sys.executable, "-m", "app", "--model-id", str(tiny_checkpoint),
                "--workers", workers, "--device", "cuda",
            ],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )  # fmt: skip
        assert started.returncode == 1
        messages.append(started.stderr.strip())
    assert messages == ["embedding-server: device 'cuda' asked for, but CUDA is not available"] * 2


def test_importing_the_supervisor_imports_no_torch() -> None:
    """test_the_supervisor_never_imports_torch without a server: its modules, imported alone."""
    code = "import sys, app.__main__, app.workers; print('torch' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert imported.stdout.strip() == "False", imported.stderr


def test_a_worker_that_dies_takes_the_others_down(workers: ServerProcess) -> None:
    first, second = workers_of(workers.process.pid)
    os.kill(first, signal.SIGKILL)
    # The supervisor exits as a shell reports the worker's death, for the orchestrator.
    assert workers.process.wait(timeout=60) == 128 + signal.SIGKILL
    assert not alive(second)
    assert "exited with -9: stopping the others" in workers.log.read_text()


def test_a_port_in_use_stops_the_start_with_a_message(
    workers: ServerProcess, tiny_checkpoint: Path
) -> None:
    second = subprocess.run(
        [
            sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(workers.port),
            "--model-id", str(tiny_checkpoint), "--workers", "2",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 1
    assert f"cannot listen on 127.0.0.1:{workers.port}: Address already in use" in second.stderr
    assert "Traceback" not in second.stderr


def test_a_worker_over_its_share_sheds_that_many_connections() -> None:
    counts = (ctypes.c_int * 2)()
    first, second = ConnectionBalance(counts, 0), ConnectionBalance(counts, 1)
    second.publish(0)
    first.publish(4)  # all four clients landed on the first worker
    assert [first.should_close() for _ in range(3)] == [True, True, False]
    assert not second.should_close()
    second.publish(2)
    first.publish(3)  # odd totals: a share is rounded up, so 3 of 5 is no excess
    assert not first.should_close() and not second.should_close()


def connections_per_worker(workers: ServerProcess) -> list[int]:
    """Established connections each worker holds, from /proc."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == workers.port and fields[3] == "01":
            inodes.add(f"socket:[{fields[9]}]")
    held = []
    for pid in workers_of(workers.process.pid):
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:  # closed meanwhile
                continue
        held.append(sum(link in inodes for link in links))
    return held


def test_keep_alive_clients_end_up_spread_over_the_workers(workers: ServerProcess) -> None:
    closes = 0

    def client() -> int:
        asked_to_close = 0
        with httpx.Client(base_url=workers.url, limits=httpx.Limits(max_connections=1)) as c:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                response = c.post("/embed", json={"inputs": "spread"})
                assert response.status_code == 200
                asked_to_close += response.headers.get("connection") == "close"
            return asked_to_close

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(client) for _ in range(6)]
        time.sleep(3.5)  # the workers publish 5 times a second; the clients still run
        held = connections_per_worker(workers)
        closes = sum(future.result() for future in running)
    assert sum(held) == 6 and max(held) - min(held) <= 2, held
    text = httpx.get(f"{workers.url}/metrics").text
    assert f"embed_connections_rebalanced_total {float(closes)}" in text
