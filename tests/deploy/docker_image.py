"""`make docker-test`: build the image on a private Docker engine, run it, and prove it.

Not part of CI (it needs root, builds for minutes and downloads dependencies from PyPI):

1. starts a private dockerd (overlay2, no bridge, no iptables) under $DOCKER_TEST_STATE,
2. builds a Debian bookworm base image with debootstrap (no image registry is reachable here)
   unless one is cached there,
3. puts the torch wheel that `pip download torch==<pinned> --no-deps` gives into deploy/wheels,
4. builds the Dockerfile cold (--no-cache), then again after a code change: the torch and
   dependency layers must come from the cache,
5. checks that the CA bundle passed as a BuildKit secret is nowhere in the image,
6. runs the container read-only as its non-root user, waits for Docker's HEALTHCHECK to say
   healthy, compares embeddings through HTTP with the in-process service (max abs diff
   <= 1e-6), then `docker stop`s it during a request: the request completes, the log shows
   the drain and the exit code is 0,
7. runs the `embed` service of docker-compose.yml through Debian's docker-compose (host
   network: this engine has no bridge) and stops it the same way.

Prints each figure as it goes and a summary at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from tests.deploy.topology import REPO, free_port

STATE = Path(os.environ.get("DOCKER_TEST_STATE", "/var/tmp/embedding-server-docker"))
# The docker.io package's client: it has BuildKit; another `docker` earlier on PATH may not.
DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
BASE_IMAGE = "embedding-server-base:bookworm"
IMAGE = "embedding-server:docker-test"
CONTAINER = "embedding-server-docker-test"
COMPOSE_PROJECT = "embeddockertest"
THREADS = 2
SENTENCES = [
    "The cat sits on the mat.",
    "Größe und Übermaß 🚀",
    "A load balancer spreads requests over replicas.",
    "short",
    "def f(x):\n    return x * 2",
]
LONG_TEXT = "throughput latency batching padding " * 60


def say(message: str) -> None:
    print(f"[docker-test] {message}", flush=True)


def run(
    command: Sequence[str],
    *,
    check: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )
    if check and result.returncode != 0:
        raise SystemExit(
            f"failed ({result.returncode}): {' '.join(command)}\n{result.stdout}\n{result.stderr}"
        )
    return result


# --- the engine -------------------------------------------------------------------------------


class Engine:
    """A dockerd of our own: its socket, data and state under STATE, so nothing else is touched."""

    def __init__(self) -> None:
        self.socket = STATE / "docker.sock"
        self.pidfile = STATE / "dockerd.pid"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "1"}
        self.process: subprocess.Popen[bytes] | None = None

    def docker(self, *args: str, check: bool = True, timeout: float = 1800) -> str:
        return run([DOCKER, *args], check=check, env=self.env, timeout=timeout).stdout

    def responds(self) -> bool:
        return run([DOCKER, "info"], check=False, env=self.env, timeout=30).returncode == 0

    def start(self) -> None:
        if self.pidfile.exists() and self.responds():
            say(f"reusing the engine at {self.socket}")
            return
        for stale in (self.pidfile, self.socket):
            stale.unlink(missing_ok=True)
        (STATE / "data").mkdir(parents=True, exist_ok=True)
        (STATE / "exec").mkdir(parents=True, exist_ok=True)
        command = [
            DOCKERD,
            "--storage-driver=overlay2",
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            f"--data-root={STATE / 'data'}",
            f"--exec-root={STATE / 'exec'}",
            f"--pidfile={self.pidfile}",
            f"--host=unix://{self.socket}",
        ]
        with (STATE / "dockerd.log").open("a") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while not self.responds():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"dockerd did not start; see {STATE / 'dockerd.log'}")
            time.sleep(0.5)
        say(f"started dockerd (pid {self.process.pid}) at {self.socket}")

    def stop(self) -> None:
        """Stops the engine only if this run started it."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        say("stopped dockerd")

    def image_exists(self, tag: str) -> bool:
        return run([DOCKER, "image", "inspect", tag], check=False, env=self.env).returncode == 0


# --- inputs of the build --------------------------------------------------------------------


def debian_mirror() -> str:
    """The Debian mirror apt uses here (the only one reachable)."""
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for source in sources:
        if not source.is_file():
            continue
        for line in source.read_text().splitlines():
            match = re.search(r"(?:^URIs:|^deb)\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?(?:\s|$)", line)
            if match:
                return match.group(1)
    return "http://deb.debian.org/debian"


def build_base_image(engine: Engine) -> float | None:
    """debootstrap bookworm + python3, imported as BASE_IMAGE; None when cached."""
    if engine.image_exists(BASE_IMAGE):
        say(f"base image {BASE_IMAGE} cached")
        return None
    started = time.monotonic()
    rootfs = STATE / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    mirror = debian_mirror()
    say(f"debootstrap bookworm from {mirror}")
    run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror])
    shutil.copy("/etc/resolv.conf", rootfs / "etc" / "resolv.conf")
    run(
        [
            "chroot",
            str(rootfs),
            "/bin/sh",
            "-c",
            "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
            "--no-install-recommends python3 python3-venv ca-certificates "
            "&& apt-get clean && rm -rf /var/lib/apt/lists/*",
        ]
    )
    (rootfs / "etc" / "resolv.conf").write_text("")  # Docker provides its own at run time
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        [DOCKER, "import", "-", BASE_IMAGE], stdin=tar.stdout, env=engine.env, capture_output=True
    )
    tar.wait()
    if imported.returncode != 0 or tar.returncode != 0:
        raise SystemExit(f"docker import failed: {imported.stderr.decode()}")
    shutil.rmtree(rootfs)
    seconds = time.monotonic() - started
    say(f"base image built in {seconds:.0f} s")
    return seconds


def torch_wheel() -> str:
    """The wheel `pip download torch==<constraints.txt's pin> --no-deps` gives, in deploy/wheels."""
    pin = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert pin, "constraints.txt pins torch"
    wheels = REPO / "deploy" / "wheels"
    download = ["download", f"torch=={pin.group(1)}", "--no-deps", "--quiet", "-d", str(wheels)]
    run([sys.executable, "-m", "pip", *download])
    (wheel,) = wheels.glob(f"torch-{pin.group(1)}*.whl")
    say(f"torch wheel: {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MiB)")
    return wheel.name


def ca_bundle() -> Path:
    """The CA bundle pip uses on this machine (it holds this network's TLS authority)."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(variable)
        if value and Path(value).is_file():
            return Path(value)
    return Path("/etc/ssl/certs/ca-certificates.crt")


def build_context(folder: Path, wheel: str) -> Path:
    """The working tree's files (tracked and untracked, not ignored) plus the wheel, so that a
    code change can be simulated without touching the working tree."""
    files = run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO
    ).stdout.split("\0")
    context = folder / "context"
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            target = context / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (context / "deploy" / "wheels").mkdir(parents=True, exist_ok=True)
    os.link(REPO / "deploy" / "wheels" / wheel, context / "deploy" / "wheels" / wheel)
    return context


def build(engine: Engine, context: Path, wheel: str, *, cold: bool) -> tuple[float, str]:
    command = [
        DOCKER,
        "build",
        "--network=host",
        "--progress=plain",
        f"--build-arg=BASE_IMAGE={BASE_IMAGE}",
        f"--build-arg=TORCH_WHEEL={wheel}",
        f"--secret=id=cacert,src={ca_bundle()}",
        f"--tag={IMAGE}",
        *(["--no-cache"] if cold else []),
        str(context),
    ]
    started = time.monotonic()
    result = run(command, env=engine.env, check=False)
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    (STATE / f"build-{'cold' if cold else 'warm'}.log").write_text(output)
    if result.returncode != 0:
        raise SystemExit(f"docker build failed:\n{output[-5000:]}")
    return seconds, output


def step_states(output: str) -> dict[str, str]:
    """Each Dockerfile step of a plain-progress build log and how it ended (CACHED or DONE)."""
    names: dict[str, str] = {}
    states: dict[str, str] = {}
    for line in output.splitlines():
        match = re.match(r"#(\d+) (\[\s*\d+/\d+\] .*)", line)
        if match:
            names[match.group(1)] = match.group(2)
        match = re.match(r"#(\d+) (CACHED|DONE)", line)
        if match:
            states[match.group(1)] = match.group(2)
    return {names[step]: states.get(step, "?") for step in names}


def state_of(steps: dict[str, str], fragment: str) -> str:
    (state,) = [state for name, state in steps.items() if fragment in name]
    return state


# --- checks on the image --------------------------------------------------------------------


def check_secret_left_nothing(engine: Engine) -> str:
    bundle = ca_bundle()
    data = bundle.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    leftover = engine.docker(
        # As root, so that find reads every directory.
        "run", "--rm", "--network=none", "--user=0", "--entrypoint=sh", IMAGE, "-c",
        f"ls -A /run/secrets 2>/dev/null; find / -xdev -type f -size {len(data)}c "
        "-exec sha256sum {} + 2>/dev/null; true",
    )  # fmt: skip
    same = [line.split()[-1] for line in leftover.splitlines() if line.startswith(digest)]
    stray = [
        line for line in leftover.splitlines() if line and not re.match(r"[0-9a-f]{64} ", line)
    ]
    assert not stray, f"/run/secrets holds {stray}"
    assert not same, f"the host's CA bundle ({bundle}) is in the image at {same}"
    history = engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE)
    assert "BEGIN CERTIFICATE" not in history
    return f"{bundle} (sha256 {digest[:12]}) is in no file of the image, /run/secrets is empty"


def wait_healthy(engine: Engine, container: str, within: float = 300) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        state = json.loads(engine.docker("inspect", "--format", "{{json .State}}", container))
        if state["Status"] != "running":
            raise SystemExit(f"{container} stopped:\n{engine.docker('logs', container)}")
        health = state.get("Health", {}).get("Status")
        if health == "healthy":
            return time.monotonic() - started
        if health == "unhealthy":
            raise SystemExit(f"{container} is unhealthy: {state['Health']['Log'][-1]}")
        time.sleep(1)
    raise SystemExit(f"{container} not healthy within {within:.0f} s")


async def in_process_embeddings(texts: list[str]) -> np.ndarray:
    """The same request answered by the service in this process (no HTTP server, no Docker)."""
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(devices=["cpu"], threads=THREADS))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://local") as client:
            for _ in range(600):
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            response = await client.post("/embed", json={"inputs": texts}, timeout=120)
    assert response.status_code == 200, response.text
    return np.array(response.json(), dtype=np.float64)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)  # over its labels (the served models)


def stop_during_a_request(
    engine: Engine, url: str, stop: Sequence[str], container: str, count: int = 128
) -> tuple[int, list[str], float]:
    """Send a request of `count` inputs of about 256 tokens (several forward passes), stop the
    container while its inputs are queued; the request must still be answered and must still
    be running when the drain starts. Returns the exit code, the drain log lines and how long
    the stop took."""
    inputs = [f"{n} {LONG_TEXT}" for n in range(count)]
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        answer["response"] = httpx.post(f"{url}/embed", json={"inputs": inputs}, timeout=300)

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 120
    while metric(url, "embed_queue_depth") == 0:
        assert sender.is_alive() and time.monotonic() < deadline, "the request never queued"
        time.sleep(0.05)
    started = time.monotonic()
    run(stop, env=engine.env)
    stopped_in = time.monotonic() - started
    sender.join(timeout=300)
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert len(response.json()) == len(inputs)
    code = int(engine.docker("inspect", "--format", "{{.State.ExitCode}}", container).strip())
    logs = run([DOCKER, "logs", container], env=engine.env).stderr
    drain = [line for line in logs.splitlines() if re.search(r"drain|Shutting down|Finished", line)]
    assert any(re.search(r"draining: [1-9]", line) for line in drain), logs
    return code, drain, stopped_in


def run_container(engine: Engine) -> dict[str, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine.docker("rm", "-f", CONTAINER, check=False)
    engine.docker(
        "run", "--detach", f"--name={CONTAINER}", "--network=host",
        # A read-only root filesystem, as in the Kubernetes manifests; /tmp is the only
        # writable place.
        "--read-only", "--tmpfs=/tmp",
        f"--env=EMBED_PORT={port}", f"--env=EMBED_THREADS={THREADS}", IMAGE,
    )  # fmt: skip
    figures: dict[str, str] = {}
    healthy_in = wait_healthy(engine, CONTAINER)
    figures["healthy (Docker HEALTHCHECK)"] = f"after {healthy_in:.0f} s"
    config = json.loads(engine.docker("inspect", "--format", "{{json .Config}}", CONTAINER))
    uid = engine.docker("exec", CONTAINER, "sh", "-c", "awk '/^Uid:/ {print $2}' /proc/1/status")
    assert config["User"] == "embed" and uid.strip() not in ("", "0"), (config["User"], uid)
    readonly = engine.docker("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", CONTAINER)
    write = run([DOCKER, "exec", CONTAINER, "touch", "/srv/probe"], check=False, env=engine.env)
    assert readonly.strip() == "true" and write.returncode != 0
    figures["user"] = f"{config['User']} (uid {uid.strip()}), root filesystem read-only"
    served = httpx.post(f"{url}/embed", json={"inputs": SENTENCES}, timeout=120)
    assert served.status_code == 200, served.text
    got = np.array(served.json(), dtype=np.float64)
    want = asyncio.run(in_process_embeddings(SENTENCES))
    difference = float(np.abs(got - want).max())
    assert got.shape == want.shape == (len(SENTENCES), 384)
    assert difference <= 1e-6, difference
    figures["embeddings vs in-process"] = f"max abs difference {difference:.2e} (<= 1e-6)"
    code, drain, stopped_in = stop_during_a_request(
        engine, url, [DOCKER, "stop", "--time=60", CONTAINER], CONTAINER
    )
    assert code == 0, code
    figures["docker stop during a 128-input request"] = (
        f"request answered 200, exit code {code}, stop took {stopped_in:.1f} s"
    )
    figures["drain log"] = "\n    " + "\n    ".join(drain)
    engine.docker("rm", "-f", CONTAINER, check=False)
    return figures


def compose_smoke(engine: Engine) -> str:
    """docker-compose.yml's `embed` service, with deploy/compose.smoke.yml on top (host
    network, this image), up, healthy, one request, stopped: the drain and exit code 0."""
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose (Debian package) is missing"
    port = free_port()
    files = ["-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "deploy/compose.smoke.yml")]
    base = [compose, "--project-name", COMPOSE_PROJECT, *files]
    env = {**engine.env, "SMOKE_IMAGE": IMAGE, "SMOKE_PORT": str(port)}
    run([*base, "config", "--quiet"], env=env)
    try:
        run([*base, "up", "--detach", "--no-build", "--no-deps", "embed"], env=env)
        (container,) = run([*base, "ps", "--quiet", "embed"], env=env).stdout.split()
        settings = json.loads(engine.docker("inspect", "--format", "{{json .}}", container))
        assert settings["HostConfig"]["ReadonlyRootfs"] is True
        wait_healthy(engine, container)
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{url}/embed", json={"inputs": "hi"}, timeout=60).status_code == 200
        # Compose sets a 5 s drain delay: the request must outlast it (about 8 s of work in
        # bfloat16 on 2 cores).
        code, _, stopped_in = stop_during_a_request(
            engine, url, [*base, "stop", "embed"], container, count=512
        )
        assert code == 0, code
    finally:
        run([*base, "down", "--timeout", "5"], env=env, check=False)
    return f"up, healthy, answered; stopped in {stopped_in:.1f} s with exit code {code}"


def image_size(engine: Engine) -> str:
    size = int(engine.docker("image", "inspect", "--format", "{{.Size}}", IMAGE))
    history = engine.docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", IMAGE)
    parts = {"/wheels/": "torch", "constraints.txt -r": "dependencies and model"}
    layers = [
        f"{name} {line.split(chr(9))[0]}"
        for line in history.splitlines()
        for fragment, name in parts.items()
        if fragment in line
    ]
    return f"{size / 1e6:.0f} MB ({', '.join(layers)}, base {base_size(engine)})"


def base_size(engine: Engine) -> str:
    size = int(engine.docker("image", "inspect", "--format", "{{.Size}}", BASE_IMAGE))
    return f"{size / 1e6:.0f} MB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--keep-engine", action="store_true", help="leave the private dockerd running"
    )
    parser.add_argument(
        "--rebuild-base", action="store_true", help="debootstrap the base image even if cached"
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("make docker-test starts its own dockerd: run it as root")
    for tool in (DOCKER, DOCKERD, shutil.which("debootstrap") or "debootstrap"):
        if not Path(tool).exists():
            raise SystemExit(f"{tool} missing: apt-get install docker.io debootstrap")
    STATE.mkdir(parents=True, exist_ok=True)
    summary: dict[str, str] = {}
    engine = Engine()
    engine.start()
    try:
        if args.rebuild_base:
            engine.docker("image", "rm", "--force", BASE_IMAGE, check=False)
        base_seconds = build_base_image(engine)
        summary["base image (debootstrap)"] = (
            "cached" if base_seconds is None else f"built in {base_seconds:.0f} s"
        )
        wheel = torch_wheel()
        with tempfile.TemporaryDirectory(dir=STATE) as folder:
            context = build_context(Path(folder), wheel)
            say("cold build (--no-cache) ...")
            cold, _ = build(engine, context, wheel, cold=True)
            summary["cold build (--no-cache)"] = f"{cold:.0f} s"
            say(f"cold build: {cold:.0f} s")
            # A change no earlier run made, or its layer would come from the cache.
            with (context / "app" / "__init__.py").open("a") as code:
                code.write(f"# a code change at {time.time_ns()}\n")
            warm, output = build(engine, context, wheel, cold=False)
            steps = step_states(output)
            assert state_of(steps, "source=deploy/wheels") == "CACHED", steps
            assert state_of(steps, "pip install -c constraints.txt") == "CACHED", steps
            assert state_of(steps, "COPY app") == "DONE", steps
            summary["build after a code change"] = (
                f"{warm:.0f} s (torch and dependency layers from the cache)"
            )
            say(f"warm build: {warm:.0f} s")
        summary["image size"] = image_size(engine)
        summary["CA bundle secret"] = check_secret_left_nothing(engine)
        summary.update(run_container(engine))
        summary["docker-compose.yml (embed service)"] = compose_smoke(engine)
    finally:
        engine.docker("rm", "-f", CONTAINER, check=False)
        # Earlier runs' images and the build cache would otherwise pile up by gigabytes under
        # STATE; the last image and the base image stay.
        engine.docker("image", "prune", "--force", check=False)
        engine.docker("builder", "prune", "--all", "--force", check=False)
        if not args.keep_engine:
            engine.stop()
    say("summary")
    for name, value in summary.items():
        print(f"  {name}: {value}")
    say("passed")


if __name__ == "__main__":
    main()
