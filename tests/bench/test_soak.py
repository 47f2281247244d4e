"""The soak script's 60-second version: the real server under wrk, then clients that
disconnect or trickle their body; nothing fails and the queue ends empty."""

from __future__ import annotations

from pathlib import Path

from bench import soak


def test_a_minute_of_mixed_traffic_and_abusive_clients(tmp_path: Path) -> None:
    # 8 connections rather than 16, and room for 25 s of queued work rather than 10: this test
    # is about errors, memory and the drained queue under sustained traffic, not admission
    # (bench.soak's overload phase is), and on a slow minute of a 2-core machine 8 clients of
    # up to 64 x 500 tokens each queue more than 10 s of work, whose 429s would count here.
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
            "--",
            "--max-queue-wait",
            "25",
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
