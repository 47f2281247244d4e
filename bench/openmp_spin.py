"""How long torch's OpenMP workers spin between passes, against the server's CPU and latency.

torch's CPU kernels run on libgomp's OpenMP, whose idle workers spin for GOMP_SPINCOUNT checks
(libgomp's default: 300,000) before they sleep. Longer than the gap between a lone client's
requests, the spinning keeps a core busy while the server is far from busy; shorter, a worker
may sleep inside a pass and have to be woken. The server leaves it to the environment; this
measures what a value does on this machine, before an operator sets it.

In one run, in rounds that rotate the spin counts, a fresh server for each (`python -m app`,
the default model and layout, plus the flags after --, GOMP_SPINCOUNT in its environment)
takes two loads of one short sentence per request:
- `1 x 1`: one wrk connection, each request sent as the last one is answered;
- `paced`: one client sending a request every --gap milliseconds, as a service that is not
  busy sees them.
For each: the p50 latency and the CPU time of all the server's processes per request. Each
figure keeps its best round; ratios are to the first spin count. Written to
bench/results/openmp_spin.json.
Usage: python -m bench.openmp_spin [--spins 300000 10000] [--seconds 8] [--gap 50]
                                   [--rounds 2] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson

from bench.side_by_side import turns
from bench.workload import short_sentences
from bench.wrk import Server, run_wrk

RESULTS = Path(__file__).resolve().parent / "results" / "openmp_spin.json"
DIMENSION = 384  # the default model's
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Figure:
    p50_ms: float
    cpu_ms_per_request: float
    requests: int


Round = dict[str, Figure]


def back_to_back(server: Server, bodies: list[str], seconds: float) -> Figure:
    before = server.cpu().total
    result = run_wrk(
        server.url, bodies, connections=1, seconds=seconds, vectors=1, dimension=DIMENSION
    )
    if result.bad or result.socket_errors:
        raise SystemExit(f"bad responses: {result.first_bad}")
    used = server.cpu().total - before
    return Figure(result.p50_ms, used / result.requests * 1e3, result.requests)


def paced(server: Server, bodies: list[str], seconds: float, gap: float) -> Figure:
    """One request every `gap` seconds, or as soon as the last one is answered if later."""
    latencies: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = server.cpu().total
        due = time.perf_counter()
        end = due + seconds
        while due < end:
            time.sleep(max(0.0, due - time.perf_counter()))
            sent = time.perf_counter()
            body = bodies[len(latencies) % len(bodies)]
            client.post("/embed", content=body, headers=JSON).raise_for_status()
            latencies.append(time.perf_counter() - sent)
            due += gap
        used = server.cpu().total - before
    return Figure(statistics.median(latencies) * 1e3, used / len(latencies) * 1e3, len(latencies))


def one_round(spins: str, bodies: list[str], args: argparse.Namespace) -> Round:
    server = Server(args.server, env={"GOMP_SPINCOUNT": spins})
    try:
        server.wait_ready()
        back_to_back(server, bodies, 2)  # warm-up
        return {
            "1 x 1": back_to_back(server, bodies, args.seconds),
            f"paced, one per {args.gap:g} ms": paced(server, bodies, args.seconds, args.gap / 1e3),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spins", nargs="+", default=["300000", "10000"])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--gap", type=float, default=50, help="ms between paced requests")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    bodies = [orjson.dumps({"inputs": text}).decode() for text in short_sentences(200)]
    rounds: dict[str, list[Round]] = {spins: [] for spins in args.spins}
    for number in range(args.rounds):
        for spins in turns(args.spins, number):
            figures = one_round(spins, bodies, args)
            rounds[spins].append(figures)
            shown = "; ".join(
                f"{load}: p50 {f.p50_ms:.2f} ms, {f.cpu_ms_per_request:.2f} ms CPU/request"
                for load, f in figures.items()
            )
            print(f"round {number + 1}, GOMP_SPINCOUNT={spins}: {shown}", flush=True)
    report(rounds, args.spins)


def report(rounds: dict[str, list[Round]], spins: list[str]) -> None:
    best = {
        count: {
            load: (
                min(run[load].p50_ms for run in runs),
                min(run[load].cpu_ms_per_request for run in runs),
            )
            for load in runs[0]
        }
        for count, runs in rounds.items()
    }
    print(f"\nbest of each; ratios to GOMP_SPINCOUNT={spins[0]}")
    for count, loads in best.items():
        for load, (p50, cpu) in loads.items():
            base_p50, base_cpu = best[spins[0]][load]
            print(
                f"GOMP_SPINCOUNT={count:>8} {load:<22} p50 {p50:6.2f} ms ({p50 / base_p50:.2f}x), "
                f"server CPU per request {cpu:6.2f} ms ({cpu / base_cpu:.2f}x)"
            )
    kept = {
        count: [{load: asdict(figure) for load, figure in run.items()} for run in runs]
        for count, runs in rounds.items()
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(kept, indent=1))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
