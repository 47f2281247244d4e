"""Slow and careless clients against the real server process, over raw sockets: the API key
is checked before the body is read, a body that trickles in gets a 408 without holding up
other clients, and connections past --max-connections get a fast 503."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.app.test_server_process import ServerProcess
from tests.helpers import make_random_checkpoint

KEY = "s3cret"
BODY_TIMEOUT = 5
MAX_CONNECTIONS = 4
# Long enough for any answer on a loaded machine; an answer that needed the body (which
# never comes) could only be a 408, which the tests tell apart by its status.
READ_TIMEOUT = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("slow-clients")
    make_random_checkpoint(folder / "tiny")
    process = ServerProcess(
        folder,
        "--model-id",
        str(folder / "tiny"),
        "--api-key",
        KEY,
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--payload-limit",
        "100000",
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT)
    return sock


def send_head(sock: socket.socket, *headers: str, path: str = "/embed") -> None:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json", *headers]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length (what uvicorn sends here)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def embed(sock: socket.socket, text: str = "hello") -> int:
    body = orjson.dumps({"inputs": text})
    send_head(sock, f"Authorization: Bearer {KEY}", f"Content-Length: {len(body)}")
    sock.sendall(body)
    status, _, _ = read_response(sock)
    return status


@pytest.mark.parametrize(
    "headers",
    [
        # A huge declared body that never comes, with a wrong key, or none.
        ("Authorization: Bearer wrong", "Content-Length: 1000000000"),
        ("Content-Length: 1000000000",),
        # A chunked body that never ends.
        ("Authorization: Bearer wrong", "Transfer-Encoding: chunked"),
    ],
)
def test_a_wrong_key_is_refused_before_the_body(
    server: ServerProcess, headers: tuple[str, ...]
) -> None:
    with connect(server) as sock:
        send_head(sock, *headers)
        if "Transfer-Encoding: chunked" in headers:
            sock.sendall(b'10\r\n{"inputs": "aaaa\r\n')  # and then nothing more
        status, _, body = read_response(sock)
    # Not 413 (the size is checked after the key) and not 408 (the body was never awaited).
    assert status == 401
    assert orjson.loads(body)["error_type"] == "Unauthorized"


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(
    server: ServerProcess,
) -> None:
    with connect(server) as sock:
        send_head(sock, f"Authorization: Bearer {KEY}", "Content-Length: 1000000000")
        status, _, body = read_response(sock)
    assert status == 413 and orjson.loads(body)["error_type"] == "PayloadTooLarge"


def test_a_slow_body_gets_408_and_others_are_served_meanwhile(server: ServerProcess) -> None:
    body = orjson.dumps({"inputs": "hello world"})
    with connect(server) as slow, connect(server) as other:
        send_head(slow, f"Authorization: Bearer {KEY}", f"Content-Length: {len(body)}")
        slow.sendall(body[:5])  # the rest never comes
        # Another client is served while the slow one holds its request open: all five
        # answers come before the slow one's 408.
        served = [embed(other) for _ in range(5)]
        readable, _, _ = select.select([slow], [], [], 0)
        status, _, answer = read_response(slow)
    assert served == [200] * 5
    assert status == 408
    assert orjson.loads(answer) == {
        "error": f"the body did not arrive within the body timeout of {BODY_TIMEOUT} s",
        "error_type": "BodyTimeout",
    }
    assert not readable  # the slow request was still waiting when the others were done


def test_connections_past_the_bound_get_a_fast_503(server: ServerProcess) -> None:
    sockets = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        # Every connection up to the bound is served, all of them open at once.
        assert [embed(sock) for sock in sockets] == [200] * MAX_CONNECTIONS
        with connect(server) as extra:
            body = orjson.dumps({"inputs": "hello"})
            send_head(extra, f"Authorization: Bearer {KEY}", f"Content-Length: {len(body)}")
            extra.sendall(body)
            status, headers, answer = read_response(extra)
        assert status == 503 and answer == b"Service Unavailable"
        assert headers["connection"] == "close"
    finally:
        sockets.pop().close()
    try:
        # With one closed, a new connection gets in (once the server has seen the close).
        deadline = time.monotonic() + 30
        while True:
            with connect(server) as sock:
                if embed(sock) == 200:
                    break
            assert time.monotonic() < deadline, "a freed connection slot was never reused"
            time.sleep(0.1)
    finally:
        for sock in sockets:
            sock.close()
    health = httpx.get(f"{server.url}/health", timeout=READ_TIMEOUT)
    assert health.status_code == 200


def test_the_server_log_has_no_traceback(server: ServerProcess) -> None:
    assert "Traceback" not in server.log.read_text()
