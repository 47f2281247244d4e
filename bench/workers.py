"""One server process against two (`--workers 2`), rounds alternating between them.

Each round starts a fresh server of each kind in turn (one process's speed is a draw of its
own) and runs bench.server's four loads on it; every answer is checked. Printed: each
figure per round, and the per-round ratio of two workers to one.
Usage: python -m bench.workers [--dtype auto] [--rounds 3] [--seconds 10] [--cores 2]
"""

from __future__ import annotations

import argparse

from bench.server import LOADS, run_load
from bench.wrk import Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto", help="auto: what the server picks here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--cores", type=int, default=2, help="torch threads in all")
    args = parser.parse_args()
    configs = {
        "1 worker": ["--threads", str(args.cores)],
        "2 workers": ["--workers", "2", "--threads", str(max(1, args.cores // 2))],
    }
    figures: dict[str, dict[str, list[float]]] = {c: {ld.name: [] for ld in LOADS} for c in configs}
    for _ in range(args.rounds):
        for config, flags in configs.items():
            server = Server(["--device", "cpu", "--dtype", args.dtype, *flags])
            try:
                server.wait_ready()
                for load in LOADS:  # warm-up
                    run_load(server, load, 2)
                for load in LOADS:
                    result = run_load(server, load, args.seconds).wrk
                    if result.bad or result.socket_errors:
                        raise SystemExit(f"{config}, {load.name}: bad answers: {result.first_bad}")
                    single = load.ceiling == "single"
                    figure = result.p50_ms if single else result.rate * load.inputs
                    figures[config][load.name].append(figure)
            finally:
                server.stop()
    one, two = configs
    for load in LOADS:
        unit = "p50 ms" if load.ceiling == "single" else "texts/s"
        a, b = figures[one][load.name], figures[two][load.name]
        ratios = ", ".join(f"{y / x:.2f}" for x, y in zip(a, b, strict=True))
        print(
            f"{args.dtype} {load.name}: {unit}, {one} {', '.join(f'{v:.1f}' for v in a)}; "
            f"{two} {', '.join(f'{v:.1f}' for v in b)}; two / one per round: {ratios}"
        )


if __name__ == "__main__":
    main()
