"""The placements on a CPU, rounds alternating between them: the engine in the server's own
process (in-process), in a process of its own behind one front end (split), and two engines
of one thread each behind two front ends (split, `--devices cpu,cpu`).

Each round starts a fresh server of each kind in turn (one process's speed is a draw of its
own) and runs bench.server's four loads on it; every answer is checked. Printed: each
figure per round, and the per-round ratio of each placement to in-process.
Usage: python -m bench.placements [--dtype auto] [--rounds 3] [--seconds 10] [--cores 2]
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
    half = str(max(1, args.cores // 2))
    configs = {
        "in-process": ["--placement", "in-process", "--threads", str(args.cores)],
        "split": ["--placement", "split", "--frontends", "1", "--threads", str(args.cores)],
        "2 engines": ["--devices", "cpu,cpu", "--frontends", "2", "--threads", half],
    }
    figures: dict[str, dict[str, list[float]]] = {c: {ld.name: [] for ld in LOADS} for c in configs}
    for _ in range(args.rounds):
        for config, flags in configs.items():
            devices = [] if "--devices" in flags else ["--devices", "cpu"]
            server = Server([*devices, "--dtype", args.dtype, *flags])
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
    base, *others = configs
    for load in LOADS:
        unit = "p50 ms" if load.ceiling == "single" else "texts/s"
        line = [f"{args.dtype} {load.name} ({unit}):"]
        line.append(f"{base} {', '.join(f'{v:.1f}' for v in figures[base][load.name])};")
        for other in others:
            ratios = ", ".join(
                f"{y / x:.2f}"
                for x, y in zip(figures[base][load.name], figures[other][load.name], strict=True)
            )
            values = ", ".join(f"{v:.1f}" for v in figures[other][load.name])
            line.append(f"{other} {values} ({ratios} of {base});")
        print(" ".join(line))


if __name__ == "__main__":
    main()
