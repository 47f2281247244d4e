"""The load generator: wrk's check of every answer, its cores, the batch sums read from
/metrics, and the side-by-side comparison's order and summary."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.side_by_side import WORKING_TREE, summary, turns
from bench.wrk import Batches, core_list, run_wrk

# What the stand-in server answers on each path: two vectors of three, or a wrong shape.
ANSWERS = {
    "/two-of-three": b"[[0.1,-0.2,3e-05],[0.4,0.5,-6E+07]]",
    "/one-of-three": b"[[0.1,0.2,0.3]]",
    "/two-of-two": b"[[0.1,0.2],[0.4,0.5]]",
    "/last-too-short": b"[[0.1,0.2,0.3],[0.4,0.5]]",
    "/empty": b"[[],[]]",
    "/cut-short": b"[[0.1,0.2,0.3],[0.4,0.5",
}


class Answering(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as wrk expects

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = ANSWERS.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # wrk resets its connections when it stops


@pytest.fixture(scope="module")
def stand_in() -> Iterator[str]:
    server = QuietServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("path", "bad"),
    [("/two-of-three", False), ("/one-of-three", True), ("/two-of-two", True),
     ("/last-too-short", True), ("/empty", True), ("/cut-short", True), ("/missing", True)],
)  # fmt: skip
def test_wrk_counts_answers_of_the_wrong_shape_as_bad(stand_in: str, path: str, bad: bool) -> None:
    result = run_wrk(
        stand_in, ['{"inputs": ["a", "b"]}'], connections=1, seconds=1, vectors=2,
        dimension=3, path=path,
    )  # fmt: skip
    assert result.requests > 0
    assert (result.bad == result.requests) if bad else (result.bad == 0), result


def test_core_list_reads_taskset_lists() -> None:
    assert core_list("0") == [0]
    assert core_list("0-3") == [0, 1, 2, 3]
    assert core_list("0,2-3,7") == [0, 2, 3, 7]


def test_batch_sums_add_up_every_label() -> None:
    exposition = "\n".join(
        [
            "# HELP embed_batch_size Inputs per forward pass.",
            'embed_batch_size_count{model="a",engine="0"} 3.0',
            'embed_batch_size_count{model="b",engine="0"} 2.0',
            'embed_batch_size_sum{model="a",engine="0"} 30.0',
            'embed_batch_size_bucket{model="a",engine="0",le="8.0"} 1.0',
            "embed_padding_ratio_sum 0.5",
            'embed_inference_duration_seconds_sum{model="a"} 0.25',
        ]
    )
    assert Batches.from_metrics(exposition) == Batches(5.0, 30.0, 0.5, 0.25)


def test_side_by_side_alternates_the_builds_and_summarises_each() -> None:
    """No build always runs first, and with three (the floor and two servers) each takes
    every place in turn; each load's figures read as their range and median."""
    builds = ["f477bca", WORKING_TREE]
    assert [turns(builds, index) for index in range(3)] == [builds, builds[::-1], builds]
    three = ["floor", "server", "server at f477bca"]
    places = [turns(three, index).index("server") for index in range(3)]
    assert sorted(places) == [0, 1, 2]
    assert summary([11.5, 9.5, 12.0, 10.5]) == "9.5 to 12.0 (median 11.0)"
