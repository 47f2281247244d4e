"""How long the server takes from its command to a ready /health, against importing torch.

Rounds alternate: `python -c "import torch"` (what no server that runs a PyTorch model
avoids), then `python -m app` in each placement asked for (default: the default one, and
in-process), each timed from the command to its first 200 from `GET /health`, then stopped
with SIGTERM. Each figure is the median of its rounds; the ratio is the server's over
torch's import in the same run. Written to bench/results/startup.json.
Usage: python -m bench.startup [--rounds 5] [--placements auto in-process] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.wrk import Server

RESULTS = Path(__file__).resolve().parent / "results" / "startup.json"
# How often /health is asked: a small share of a start's seconds.
POLL_SECONDS = 0.02


def import_torch_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def ready_seconds(placement: str, flags: list[str]) -> float:
    started = time.perf_counter()
    server = Server(["--placement", placement, *flags])
    try:
        server.wait_ready(poll=POLL_SECONDS)
        return time.perf_counter() - started
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--placements", nargs="+", default=["auto", "in-process"])
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    flags = [*args.server, "--drain-delay", "0"]  # stopping is not what is timed
    figures: dict[str, list[float]] = {"import torch": []}
    figures.update({placement: [] for placement in args.placements})
    for _ in range(args.rounds):
        figures["import torch"].append(import_torch_seconds())
        for placement in args.placements:
            figures[placement].append(ready_seconds(placement, flags))
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"median of {args.rounds} alternating rounds; server flags: {' '.join(flags)}")
    for name, seconds in medians.items():
        ratio = seconds / medians["import torch"]
        what = name if name == "import torch" else f"ready, placement {name}"
        print(f"{what:<32}{seconds:>7.2f} s{ratio:>8.2f}x import torch")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"flags": flags, "seconds": figures}, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
