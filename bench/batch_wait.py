"""The batch-fill wait on and off: two servers at once, wrk rounds alternating between them.

Separate runs on this machine drift by tens of percent; alternating rounds gives both servers
the same conditions. Usage: python -m bench.batch_wait [--rounds 4] [--seconds 10]
                                 [--device cuda --threads 4 --client-cores 0-3]
                                 [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import statistics

import orjson

from bench.workload import short_sentences
from bench.wrk import WRK_CORE, Server, WrkResult, run_wrk

# Both named: the default depends on the device (Settings.batch_wait).
CONFIGS = {
    "batch wait 0 ms": ["--batch-wait-ms", "0"],
    "batch wait 50 ms": ["--batch-wait-ms", "50"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", default="2", help="each server's torch threads")
    parser.add_argument("--client-cores", default=WRK_CORE, help="wrk's CPUs (taskset's list)")
    parser.add_argument("server", nargs="*", help="after --, flags for both servers")
    args = parser.parse_args()
    bodies = [orjson.dumps({"inputs": s}).decode() for s in short_sentences(4096)]
    servers = {
        name: Server(["--devices", args.device, "--threads", args.threads, *args.server, *flags])
        for name, flags in CONFIGS.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in servers}

    def load(server: Server, seconds: float) -> WrkResult:
        return run_wrk(
            server.url,
            bodies,
            connections=args.clients,
            seconds=seconds,
            vectors=1,
            dimension=384,
            cores=args.client_cores,
        )

    try:
        for server in servers.values():
            server.wait_ready()
            load(server, 2)  # warm-up
        for _ in range(args.rounds):
            for name, server in servers.items():
                result = load(server, args.seconds)
                if result.bad or result.socket_errors:
                    raise SystemExit(f"{name}: bad answers: {result.first_bad}")
                rates[name].append(result.rate)
    finally:
        for server in servers.values():
            server.stop()
    for name, values in rates.items():
        print(
            f"{name}: requests/s per round {', '.join(f'{v:.0f}' for v in values)}; "
            f"best {max(values):.0f}, mean {statistics.mean(values):.0f}"
        )
    off, on = (statistics.mean(values) for values in rates.values())
    print(f"ratio of means, wait on / off: {on / off:.2f}")


if __name__ == "__main__":
    main()
