"""The soak script's 60-second version: the real server under wrk, then clients that
disconnect or trickle their body; nothing fails and the queue ends empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak

pytestmark = pytest.mark.slow


def test_a_minute_of_mixed_traffic_and_abusive_clients(tmp_path: Path) -> None:
    # 8 connections rather than 16: on a loaded 2-core machine the queue's estimate must
    # stay within the request timeout, or a 429 would count as an error.
    report = soak.main(
        [
            "--duration",
            "60",
            "--phases",
            "soak,abuse",
            "--abuse",
            "10",
            "--connections",
            "8",
            "--clients",
            "8",
            "--out",
            str(tmp_path / "soak.json"),
        ]
    )
    [minute] = report["soak"]["minutes"]
    assert minute["requests"] > 0 and minute["statuses"] == {"200": minute["requests"]}
    assert report["soak"]["errors"] == 0
    empty = {"embed_queue_depth": 0.0, "embed_queue_tokens": 0.0}
    assert report["queue_after_soak"] == empty
    assert report["queue_after_abuse"] == empty
    assert report["abuse"]["abandoned_requests_sent"] > 0
    assert report["exit_code"] == 0
    assert report["tracebacks_in_server_log"] == 0
    assert (tmp_path / "soak.json").exists()
