"""The batch-fill wait on and off: two servers at once, load rounds alternating between them.

Separate runs on this machine drift by tens of percent; alternating rounds gives both servers
the same conditions. Usage: python -m bench.batch_wait [--rounds 4] [--requests 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import statistics
import subprocess

from bench.server import load, make_sentences, start_server, wait_ready

CONFIGS = {"batch wait 0 ms": ["--batch-wait-ms", "0"], "batch wait 50 ms": []}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    servers: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    try:
        for name, flags in CONFIGS.items():
            port = free_port()
            servers[name] = (port, start_server(port, 2, flags))
        for port, process in servers.values():
            wait_ready(f"http://127.0.0.1:{port}", process)
            asyncio.run(load("127.0.0.1", port, make_sentences(200, seed=1), args.concurrency))
        rates: dict[str, list[float]] = {name: [] for name in servers}
        sentences = make_sentences(args.requests)
        for _ in range(args.rounds):
            for name, (port, _) in servers.items():
                result = asyncio.run(load("127.0.0.1", port, sentences, args.concurrency))
                rates[name].append(result.requests_per_second)
    finally:
        for _, process in servers.values():
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    for name, values in rates.items():
        print(
            f"{name}: requests/s per round {', '.join(f'{v:.0f}' for v in values)}; "
            f"best {max(values):.0f}, mean {statistics.mean(values):.0f}"
        )
    off, on = (statistics.mean(values) for values in rates.values())
    print(f"ratio of means, wait on / off: {on / off:.2f}")


if __name__ == "__main__":
    main()
