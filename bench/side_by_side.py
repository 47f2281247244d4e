"""Two builds of the server side by side: a git revision and the working tree, both up at
once, with wrk alternating between them.

On a shared machine whose speed drifts by tens of percent from one minute to the next (2x
seen), two figures from separate runs compare poorly; run in turns, seconds apart, each
round meets the same drift in both. The revision is checked out in a temporary git worktree
and served from it with this environment's packages (`python -m app` imports from its working
directory first). For each load of bench.server's (1 x 1's p50, the others' texts/s), every
round's figure per build, in turns whose order rotates, then each build's range and
median. Not in CI.
Usage: python -m bench.side_by_side REVISION [--rounds 4] [--seconds 5]
                                    [--loads "1 x 1 short" "32 x 1 short"] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

from bench.server import LOADS, Load, run_load
from bench.wrk import Server

T = TypeVar("T")
WORKING_TREE = "working tree"
SINGLE = "1 x 1 short"  # its figure is the p50 latency; every other load's, texts/s


@contextmanager
def checkout(revision: str) -> Iterator[Path]:
    """`revision` in a temporary git worktree, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="embed-side-") as parent:
        folder = Path(parent) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(folder), revision],
            check=True,
            capture_output=True,
        )
        # What an install builds and git ignores: the gRPC modules (app/grpc/generate.py),
        # which a revision from before them goes without.
        subprocess.run([sys.executable, "-m", "app.grpc.generate"], cwd=folder, check=False)
        try:
            yield folder
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(folder)], check=False)


def figure(load: Load, server: Server, seconds: float) -> float:
    """One run of `load`: its p50 in ms for one client of one sentence, else texts/s."""
    result = run_load(server, load, seconds).wrk
    return result.p50_ms if load.name == SINGLE else result.rate * load.inputs


def turns(names: Sequence[T], round_index: int) -> list[T]:
    """The order in a round: rotated by one each round, so that each takes every place in
    turn (with two, they alternate; a reversal would keep the middle of three in place)."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def summary(values: Sequence[float]) -> str:
    """A build's figures for one load: their range and median."""
    return f"{min(values):.1f} to {max(values):.1f} (median {statistics.median(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("revision", help="the git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--loads", nargs="+", default=[load.name for load in LOADS])
    parser.add_argument("server", nargs="*", help="flags for both servers, after --")
    # Intermixed: the revision comes before the options, the server's flags after them.
    args = parser.parse_intermixed_args()
    loads = [load for load in LOADS if load.name in args.loads]
    with ExitStack() as stack:
        base = stack.enter_context(checkout(args.revision))
        servers = {args.revision: Server(args.server, source=base)}
        servers[WORKING_TREE] = Server(args.server)
        for server in servers.values():
            stack.callback(server.stop)
        for server in servers.values():
            server.wait_ready()
        for load in loads:  # warm-up: the first seconds of a fresh server are slower
            for server in servers.values():
                run_load(server, load, 2)
        figures: dict[tuple[str, str], list[float]] = {}
        for round_index in range(args.rounds):
            for load in loads:
                for name in turns(list(servers), round_index):
                    value = figure(load, servers[name], args.seconds)
                    figures.setdefault((load.name, name), []).append(value)
    print(f"{args.revision} against the working tree, {args.rounds} rounds in turns")
    for load in loads:
        unit = "p50 ms" if load.name == SINGLE else "texts/s"
        cells = ", ".join(f"{name} {summary(figures[load.name, name])}" for name in servers)
        print(f"  {load.name} ({unit}): {cells}")


if __name__ == "__main__":
    main()
