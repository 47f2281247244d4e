"""What each of the server's processes holds in memory, after a load.

Starts the real server (`python -m app`, the flags after --), runs wrk at 32 x 1 short
sentences for --seconds, and prints each process's RSS and PSS (smaps_rollup: shared pages
split among the processes that map them, so PSS adds up) by its name in ps: the supervisor,
the engines (embed-engine) and the front ends (embed-frontend), or the one server process.
Usage: python -m bench.memory [--seconds 5] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.server import LOADS, bodies
from bench.wrk import Server, children, run_wrk


def kib(pid: int, file: str, field: str) -> int:
    for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/{file}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    server = Server(args.server)
    try:
        server.wait_ready()
        load = next(load for load in LOADS if load.name == "32 x 1 short")
        result = run_wrk(
            server.url,
            bodies(load),
            connections=load.clients,
            seconds=args.seconds,
            vectors=load.inputs,
            dimension=int(str(server.info()["dimensions"])),
        )
        if result.bad or result.socket_errors:
            raise SystemExit(f"the load failed: {result.first_bad}")
        print(f"after {args.seconds:.0f} s of {load.name}: process, RSS MiB, PSS MiB")
        total = 0
        for pid in [server.process.pid, *children(server.process.pid)]:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            pss = kib(pid, "smaps_rollup", "Pss")
            total += pss
            print(f"  {name:<16} {kib(pid, 'status', 'VmRSS') / 1024:7.0f} {pss / 1024:7.0f}")
        print(f"  {'all, PSS':<16} {'':>7} {total / 1024:7.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
