"""The load generator's helpers: wrk's cores, the batch sums read from /metrics, and the
side-by-side comparison's order and summary."""

from __future__ import annotations

from bench.side_by_side import WORKING_TREE, summary, turns
from bench.wrk import Batches, core_list


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
