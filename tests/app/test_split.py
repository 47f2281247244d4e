"""The split placement: engine processes behind front-end processes on one port, with real
processes: metrics in one /metrics, one stop for all, a dead engine or front end, torch only
in the engines."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.balance import ConnectionBalance
from app.run_folder import MARKER
from tests.app.test_server_process import ServerProcess, free_port


def children_of(supervisor: int, name: str) -> list[int]:
    """The supervisor's children named `name` (embed-engine, embed-frontend) in ps."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = (stat.parent / "comm").read_text().strip()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == supervisor and comm == name:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def engines_of(server: ServerProcess) -> list[int]:
    return children_of(server.process.pid, "embed-engine")


def frontends_of(server: ServerProcess) -> list[int]:
    return children_of(server.process.pid, "embed-frontend")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def scrape(url: str) -> str:
    # A fresh connection per scrape, so that the scrapes reach either front end.
    return httpx.get(f"{url}/metrics", headers={"Connection": "close"}).text


def metric(text: str, name: str) -> float:
    """A metric's value, summed over its labels (the served models)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(value) for value in found)


def start(tmp_path: Path, checkpoint: Path, *flags: str, devices: str = "cpu") -> ServerProcess:
    server = ServerProcess(
        tmp_path, "--model-id", str(checkpoint), "--placement", "split", "--access-log",
        *flags, devices=devices, threads="1",
    )  # fmt: skip
    frontends = int(flags[flags.index("--frontends") + 1]) if "--frontends" in flags else 0
    server.wait_ready(frontends=frontends)
    return server


@pytest.fixture
def split(tmp_path: Path, tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    server = start(
        tmp_path,
        tiny_checkpoint,
        "--frontends",
        "2",
        "--drain-delay",
        "1",
        "--max-batch-inputs",
        "1",
    )
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_a_stop_while_front_ends_start_exits_cleanly(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """A front end spawned a moment ago has no handler yet: the stop kills it, and the
    container's exit still says a clean stop."""
    server = ServerProcess(
        tmp_path, "--model-id", str(tiny_checkpoint), "--placement", "split", "--frontends", "2",
        threads="1",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "front end(s) on" not in server.log.read_text():
        assert server.process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0, server.log.read_text()
    log = server.log.read_text()
    assert "stopped while it started" in log and "Traceback" not in log


def test_front_ends_share_the_port_and_one_scrape_shows_every_process(
    split: ServerProcess,
) -> None:
    frontends = frontends_of(split)
    assert len(frontends) == 2 and len(engines_of(split)) == 1
    answered_by: set[str] = set()
    sent = 0
    # New connections until both front ends have answered one (the kernel picks).
    while len(answered_by) < 2 and sent < 300:
        response = httpx.post(
            f"{split.url}/embed", json={"inputs": f"text {sent}"}, headers={"Connection": "close"}
        )
        assert response.status_code == 200
        sent += 1
        answered_by = set(
            re.findall(r" (\d+) INFO uvicorn.access: .*POST /embed", split.log.read_text())
        )
    assert answered_by == {str(pid) for pid in frontends}
    for _ in range(6):  # whichever front end answers: both front ends' and the engine's
        text = scrape(split.url)
        assert metric(text, 'embed_requests_total{route="/embed",status="200"}') == sent
        assert metric(text, "embed_batch_size_count") >= 1  # the engine's batches
        assert metric(text, "embed_inputs_total") == sent
        assert metric(text, "embed_queue_duration_seconds_count") == sent
    assert len(re.findall(r"^embed_model_info\{.*\} 1\.0$", text, re.M)) == 1


def test_the_engine_queue_shows_in_every_front_ends_metrics(split: ServerProcess) -> None:
    with ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(
            httpx.post, f"{split.url}/embed", json={"inputs": ["a b c"] * 2000}, timeout=120
        )
        depths = []
        while not long_request.done():
            depths.append(metric(scrape(split.url), "embed_queue_depth"))
        assert long_request.result().status_code == 200
    assert max(depths) > 0
    assert metric(scrape(split.url), "embed_queue_depth") == 0


def libraries_of(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(f[5]).name for f in map(str.split, maps) if len(f) >= 6}


def test_only_the_engines_import_torch(split: ServerProcess) -> None:
    """Front ends start fast and stay small; the supervisor only spawns and watches."""
    (engine,) = engines_of(split)
    assert "libtorch_cpu.so" in libraries_of(engine)
    for pid in [split.process.pid, *frontends_of(split)]:
        assert not any(name.startswith("libtorch") for name in libraries_of(pid))


def threads_of(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def test_front_ends_tokenize_a_batch_on_the_thread_that_asks(split: ServerProcess) -> None:
    """No pool of tokenizers' own threads (one per CPU in every front end, spinning while
    they wait): the setting is inherited from the supervisor, and a batch of texts small
    enough for the event loop starts no thread."""
    if os.environ.get("TOKENIZERS_PARALLELISM") not in (None, "false"):
        pytest.skip("the operator's own TOKENIZERS_PARALLELISM is kept, by design")
    frontends = frontends_of(split)
    for pid in frontends:
        assert b"TOKENIZERS_PARALLELISM=false" in Path(f"/proc/{pid}/environ").read_bytes()
    before = {pid: threads_of(pid) for pid in frontends}
    # Each on a fresh connection, which the kernel gives to either front end by its hash:
    # that one of the two gets none of 16 is a chance of 1 in 32,768.
    for _ in range(16):
        texts = [f"sentence number {n} of a batch" for n in range(64)]
        reply = httpx.post(
            f"{split.url}/embed", json={"inputs": texts}, headers={"Connection": "close"}
        )
        assert reply.status_code == 200 and len(reply.json()) == 64
    assert {pid: threads_of(pid) for pid in frontends} == before


def test_importing_a_front_end_imports_no_torch() -> None:
    code = (
        "import sys, app.__main__, app.supervisor, app.server, app.main, app.engine.remote; "
        "print('torch' in sys.modules)"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert imported.stdout.strip() == "False", imported.stderr


def queued(pool: ThreadPoolExecutor, server: ServerProcess, inputs: int) -> Future[httpx.Response]:
    """A request of `inputs` short texts, sent from `pool`, once its inputs are queued."""
    in_flight = pool.submit(
        httpx.post, f"{server.url}/embed", json={"inputs": ["a b c"] * inputs}, timeout=120
    )
    while metric(scrape(server.url), "embed_queue_depth") == 0:
        assert not in_flight.done()
    return in_flight


def test_sigterm_finishes_work_in_flight_across_processes(
    split: ServerProcess,
) -> None:
    pids = [*engines_of(split), *frontends_of(split)]
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    metrics = next(v for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    run_dir = Path(metrics.split(b"=", 1)[1].decode()).parent  # sockets, board, metrics
    assert run_dir.is_dir()
    with ThreadPoolExecutor(1) as pool:
        in_flight = queued(pool, split, 1500)
        split.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # within the drain delay: /health says 503, work is still accepted
        assert httpx.get(f"{split.url}/health").status_code == 503
        assert in_flight.result().status_code == 200
    assert split.process.wait(timeout=60) == 0
    assert not any(alive(pid) for pid in pids)
    log = split.log.read_text()
    assert log.count("Finished server process") == 2 and "engine 0 stopped" in log
    assert "Traceback" not in log
    assert not run_dir.exists()


def test_sigterm_to_every_process_at_once_drains_once(split: ServerProcess) -> None:
    """As systemd stops a service (its default `KillMode=control-group`): SIGTERM to each of
    its processes at the same moment. The children leave it to the supervisor, whose stop
    drains them once; a front end that counted both skipped its drain, and an engine
    stopped under front ends still accepting work."""
    children = [*engines_of(split), *frontends_of(split)]
    with ThreadPoolExecutor(1) as pool:
        in_flight = queued(pool, split, 1500)
        for pid in [split.process.pid, *children]:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)  # within the drain delay: /health says 503, work is still accepted
        assert httpx.get(f"{split.url}/health").status_code == 503
        late = httpx.post(f"{split.url}/embed", json={"inputs": "late"}, timeout=120)
        assert late.status_code == 200
        assert in_flight.result().status_code == 200
    assert split.process.wait(timeout=60) == 0
    assert not any(alive(pid) for pid in children)
    log = split.log.read_text()
    assert "second signal" not in log and "Traceback" not in log


def test_a_second_signal_to_the_supervisor_ends_the_front_ends_at_once(
    split: ServerProcess,
) -> None:
    children = [*engines_of(split), *frontends_of(split)]
    with ThreadPoolExecutor(1) as pool:
        in_flight = queued(pool, split, 2000)
        split.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        split.process.send_signal(signal.SIGTERM)
        assert split.process.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(httpx.TransportError):  # cut off, not finished
            in_flight.result()
    assert not any(alive(pid) for pid in children)
    assert "second signal during the drain: exiting now" in split.log.read_text()


def test_a_killed_engine_fails_live_and_its_requests_and_stops_the_container(
    split: ServerProcess,
) -> None:
    (engine,) = engines_of(split)
    frontends = frontends_of(split)
    with ThreadPoolExecutor(1) as pool:
        in_flight = queued(pool, split, 2000)
        os.kill(engine, signal.SIGKILL)
        lives: list[int] = []
        while split.process.poll() is None and len(lives) < 50:
            try:
                lives.append(httpx.get(f"{split.url}/live", timeout=1).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.02)
        failed = in_flight.result()
    assert 503 in lives  # an orchestrator sees the container dead, not half-serving
    assert failed.status_code == 500 and "engine has stopped" in failed.json()["error"]
    assert split.process.wait(timeout=60) == 128 + signal.SIGKILL
    assert not any(alive(pid) for pid in frontends)
    assert "engine-0 exited with -9: stopping the others" in split.log.read_text()


def test_every_process_of_the_server_holds_its_run_folder(split: ServerProcess) -> None:
    """A killed server's folder is removed by the next one once none of its processes holds
    it (app/run_folder.py, tests/app/test_run_folder.py): here each of them does."""
    (engine,) = engines_of(split)
    environ = Path(f"/proc/{engine}/environ").read_bytes().split(b"\0")
    [metrics] = [
        v for k, _, v in (e.partition(b"=") for e in environ) if k == b"PROMETHEUS_MULTIPROC_DIR"
    ]
    marker = Path(metrics.decode()).parent / MARKER
    inode = f":{marker.stat().st_ino} "
    holders = {
        int(fields[4])
        for line in Path("/proc/locks").read_text().splitlines()
        if (fields := line.split())[1] == "FLOCK" and inode in line
    }
    assert {split.process.pid, engine, *frontends_of(split)} <= holders


def test_a_killed_front_end_stops_the_container(split: ServerProcess) -> None:
    first, second = frontends_of(split)
    (engine,) = engines_of(split)
    os.kill(first, signal.SIGKILL)
    assert split.process.wait(timeout=60) == 128 + signal.SIGKILL
    assert not alive(second) and not alive(engine)
    assert "frontend-0 exited with -9: stopping the others" in split.log.read_text()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_two_engines_on_the_cpu_share_the_work(tmp_path: Path, tiny_checkpoint: Path) -> None:
    server = start(tmp_path, tiny_checkpoint, devices="cpu,cpu")
    try:
        engines = engines_of(server)
        assert len(engines) == 2
        before = [cpu_seconds(pid) for pid in engines]
        body = {"inputs": ["the quick brown fox jumps over the lazy dog"] * 64}

        def send(_: int) -> int:
            return httpx.post(f"{server.url}/embed", json=body, timeout=60).status_code

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(send, range(64))) == {200}
        used = [cpu_seconds(pid) - start for pid, start in zip(engines, before, strict=True)]
        assert min(used) > 0.1 * max(used), used  # both ran forward passes
        assert server.stop() == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_a_slow_reader_holds_up_no_one_else(split: ServerProcess) -> None:
    """A client that sends a request for a large answer and never reads it."""
    with socket.create_connection(("127.0.0.1", split.port)) as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b'{"inputs": ["' + b"a " * 200 + b'"]}'
        request = (
            b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        for _ in range(20):
            slow.sendall(request)
        started = time.monotonic()
        for _ in range(20):
            assert httpx.post(f"{split.url}/embed", json={"inputs": "others"}).status_code == 200
        assert time.monotonic() - started < 10


def test_a_device_that_cannot_work_stops_the_start_with_the_reason(
    tiny_checkpoint: Path,
) -> None:
    """Checked in a child process where the supervisor has no torch, with the same message
    in both placements; no GPU is visible to it here, whatever the machine has."""
    messages = []
    for placement in ("in-process", "split"):
        started = subprocess.run(
            [
                sys.executable, "-m", "app", "--model-id", str(tiny_checkpoint),
                "--placement", placement, "--devices", "cuda",
            ],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )  # fmt: skip
        assert started.returncode == 1
        messages.append(started.stderr.strip())
    assert messages == ["embedding-server: device 'cuda' asked for, but CUDA is not available"] * 2


def test_an_engine_that_cannot_load_stops_the_start(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    started = subprocess.run(
        [
            sys.executable, "-m", "app", "--model-id", str(broken), "--placement", "split",
            "--host", "127.0.0.1", "--port", str(free_port()),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert started.returncode == 1
    assert f"model {broken}: engine 0 (engine-0) failed to start" in started.stderr


def test_an_engine_killed_while_it_loads_gives_its_exit_code(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """Killed before it could say why (the OOM killer while it loads), an engine's death is
    the supervisor's exit code, 128 + the signal, as after start-up."""
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "app", "--model-id", str(tiny_checkpoint),
            "--placement", "split", "--host", "127.0.0.1", "--port", str(free_port()),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (engines := children_of(server.pid, "embed-engine")):
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.01)
        os.kill(engines[0], signal.SIGKILL)  # still importing torch: seconds from ready
        assert server.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        server.kill()
        log.close()
    assert (
        "failed to start: the engine process exited with -9"
        in (tmp_path / "server.log").read_text()
    )


def test_a_port_in_use_stops_the_start_with_a_message(
    split: ServerProcess, tiny_checkpoint: Path
) -> None:
    second = subprocess.run(
        [
            sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(split.port),
            "--model-id", str(tiny_checkpoint), "--placement", "split",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 1
    assert f"cannot listen on 127.0.0.1:{split.port}: Address already in use" in second.stderr
    assert "Traceback" not in second.stderr


def test_a_front_end_over_its_share_sheds_that_many_connections() -> None:
    counts = (ctypes.c_int * 2)()
    first, second = ConnectionBalance(counts, 0), ConnectionBalance(counts, 1)
    second.publish(0)
    first.publish(4)  # all four clients landed on the first worker
    assert [first.should_close() for _ in range(3)] == [True, True, False]
    assert not second.should_close()
    second.publish(2)
    first.publish(3)  # odd totals: a share is rounded up, so 3 of 5 is no excess
    assert not first.should_close() and not second.should_close()


def connections_per_frontend(split: ServerProcess) -> list[int]:
    """Established connections each front end holds, from /proc."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == split.port and fields[3] == "01":
            inodes.add(f"socket:[{fields[9]}]")
    held = []
    for pid in frontends_of(split):
        links = []
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:  # closed meanwhile
                continue
        held.append(sum(link in inodes for link in links))
    return held


def test_keep_alive_clients_end_up_spread_over_the_front_ends(split: ServerProcess) -> None:
    closes = 0

    def client() -> int:
        asked_to_close = 0
        with httpx.Client(base_url=split.url, limits=httpx.Limits(max_connections=1)) as c:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                response = c.post("/embed", json={"inputs": "spread"})
                assert response.status_code == 200
                asked_to_close += response.headers.get("connection") == "close"
            return asked_to_close

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(client) for _ in range(6)]
        time.sleep(3.5)  # the front ends publish 5 times a second; the clients still run
        held = connections_per_frontend(split)
        closes = sum(future.result() for future in running)
    assert sum(held) == 6 and max(held) - min(held) <= 2, held
    text = httpx.get(f"{split.url}/metrics").text
    assert f"embed_connections_rebalanced_total {float(closes)}" in text


def test_the_device_check_dies_with_a_supervisor_stopped_meanwhile() -> None:
    """A stop signal before the supervisor's handlers are set ends it at once: the spawned
    process that checks the devices (torch, perhaps a CUDA context) goes with it."""
    supervisor = subprocess.Popen(
        [
            sys.executable, "-c",
            "from app.supervisor import resolve_devices_in_child as check; "
            "import time; check(['cpu']); time.sleep(60)",
        ],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # Two: multiprocessing's resource tracker, then the checking process.
        while len(checking := descendants(supervisor.pid)) < 2:
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.01)
        supervisor.kill()
        supervisor.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in checking) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in checking)
    finally:
        supervisor.kill()


def descendants(root: int) -> list[int]:
    """Every process below `root`, by their parent links in /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # exited meanwhile
            continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found
