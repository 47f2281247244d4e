"""The real server against the in-process ceiling of this project's own encoder, per dtype.

In one run, one process at a time, for each dtype:
1. The ceiling, in a child process: the encoder on the same texts, tokenization included,
   sorted by length, in batches of 32, for short sentences and long passages; and the p50 of
   one single-sentence call (tokenize, forward, pool).
2. The real server (`python -m app`, loopback) under wrk on --client-cores: 1 x 1, 32 x 1,
   4 x 32 and 256 x 1 short sentences, and 32 x 1 long passages (clients x inputs per request),
   every response checked (status, vector count, dimension).
Rounds alternate the two, each with a fresh server, and each figure keeps its best round:
this machine's speed drifts by tens of percent from one minute to the next. Each server
figure comes with its ratio to the ceiling, the server's peak RSS, where its CPU went (per
text, by role: the front ends' event loops and other threads, the engines), its batches
(size, padding) and the share of the time its forward passes ran, which tell why a figure
falls short of the ceiling; all is printed and written to bench/results/server.json.
Usage: python -m bench.server [--dtypes float32 bfloat16 int8] [--seconds 10] [--rounds 2]
                              [--device cpu|cuda] [--model-id ID] [--client-cores 0-3]
                              [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from bench.workload import long_passages, short_sentences
from bench.wrk import WRK_CORE, Server, WrkResult, engines_in, run_wrk
from model import DEFAULT_MODEL_ID

RESULTS = Path(__file__).resolve().parent / "results" / "server.json"
BATCH = 32
DIMENSION = 384  # the default model's


@dataclass(frozen=True)
class Load:
    name: str
    clients: int
    inputs: int  # per request
    long: bool
    ceiling: str  # the ceiling figure it is compared with


LOADS = (
    Load("1 x 1 short", 1, 1, False, "single"),
    Load("32 x 1 short", 32, 1, False, "short"),
    Load("4 x 32 short", 4, 32, False, "short"),
    Load("32 x 1 long", 32, 1, True, "long"),
    # Many clients at once, as a GPU behind a fleet of callers sees them.
    Load("256 x 1 short", 256, 1, False, "short"),
)


def ceiling(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    """Run in a child process: texts/s for short and long, single-call p50, peak RSS."""
    import torch

    from model import Embedder

    torch.set_num_threads(args.threads)
    embedder = Embedder.load(
        args.model_id or DEFAULT_MODEL_ID, device=args.device, dtype=dtype, prepack=args.prepack
    )
    embedder.capture_graphs()  # as the server does at start-up (none on the CPU)
    figures: dict[str, float] = {}
    for name, texts in (("short", short_sentences(2048)), ("long", long_passages(256))):
        ordered = sorted(texts, key=len)
        batches = [ordered[start : start + BATCH] for start in range(0, len(ordered), BATCH)]
        # Two passes, the second timed: on a GPU each new eager shape pays for choosing its
        # kernels once, several times the cost of a pass with its kernels chosen.
        for _ in range(2):
            started = time.perf_counter()
            for batch in batches:
                embedder.embed(batch)
        figures[name] = len(ordered) / (time.perf_counter() - started)
    singles = []
    for sentence in short_sentences(300, seed=2):
        started = time.perf_counter()
        embedder.embed([sentence])
        singles.append(time.perf_counter() - started)
    figures["single_p50_ms"] = statistics.median(singles[50:]) * 1000
    status = Path("/proc/self/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
    figures["peak_rss_mib"] = int(kib) / 1024
    return figures


def measure_ceiling(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "bench.server",
        "--ceiling-of",
        dtype,
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        *(["--model-id", args.model_id] if args.model_id else []),
        *([] if args.prepack else ["--no-prepack"]),
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    figures: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    return figures


def bodies(load: Load) -> list[str]:
    texts = long_passages(256, seed=5) if load.long else short_sentences(4096, seed=5)
    chunks = [texts[i : i + load.inputs] for i in range(0, len(texts), load.inputs)]
    return [
        orjson.dumps({"inputs": chunk}).decode() for chunk in chunks if len(chunk) == load.inputs
    ]


@dataclass(frozen=True)
class LoadRun:
    wrk: WrkResult
    # CPU per text (bench/wrk.py's ServerCpu): the front ends' event loops and other threads,
    # and the engines.
    frontend_loop_ms: float
    frontend_other_ms: float
    engine_ms: float
    batch_inputs: float  # mean inputs per forward pass
    padding: float  # mean padded share of a forward pass's tokens
    busy: float  # share of the run each worker spent in forward passes


def run_load(
    server: Server,
    load: Load,
    seconds: float,
    client_cores: str = WRK_CORE,
    dimension: int = DIMENSION,
) -> LoadRun:
    cpu, batches = server.cpu(), server.batches()
    result = run_wrk(
        server.url,
        bodies(load),
        connections=load.clients,
        seconds=seconds,
        vectors=load.inputs,
        dimension=dimension,
        cores=client_cores,
    )
    # Read before settling, so that the probes do not count: the work still running for
    # wrk's last requests (at most one batch per worker) is left out instead.
    cpu, batches = server.cpu() - cpu, server.batches() - batches
    server.settle()
    texts = max(result.requests * load.inputs, 1)
    return LoadRun(
        result,
        frontend_loop_ms=cpu.frontend_loops / texts * 1000,
        frontend_other_ms=cpu.frontend_other / texts * 1000,
        engine_ms=cpu.engines / texts * 1000,
        batch_inputs=batches.inputs / max(batches.count, 1),
        padding=batches.padding / max(batches.count, 1),
        busy=batches.seconds / (result.seconds * server.engines),
    )


def benchmark(dtype: str, args: argparse.Namespace) -> dict[str, object]:
    ceilings = []
    results: dict[str, list[LoadRun]] = {load.name: [] for load in LOADS}
    rss: dict[str, float] = {}
    flags = ["--dtype", dtype, *(["--model-id", args.model_id] if args.model_id else [])]
    if engines_in(args.server) == 1:
        flags += ["--devices", args.device, "--threads", str(args.threads)]
    # Else each engine's threads are the server's default, its share of the CPUs: the
    # ceiling's threads in every engine would oversubscribe them (see Settings).
    flags += args.server + ([] if args.prepack else ["--no-prepack"])
    info: dict[str, object] = {}
    for _ in range(args.rounds):
        # The ceiling runs alone; then a fresh server: one process's speed is a draw of its
        # own (one process's 1 x 1 p50 differs from the next's by more than most changes).
        ceilings.append(measure_ceiling(dtype, args))
        server = Server(flags)
        try:
            server.wait_ready()
            info = server.info()
            dimension = int(str(info["dimensions"]))
            for load in LOADS:  # warm-up: the first seconds of a fresh server are slower
                run_load(server, load, 2, args.client_cores, dimension)
            for load in LOADS:
                run = run_load(server, load, args.seconds, args.client_cores, dimension)
                results[load.name].append(run)
                rss[load.name] = max(rss.get(load.name, 0.0), server.peak_rss_mib())
        finally:
            server.stop()
    best_ceiling = {key: max(c[key] for c in ceilings) for key in ("short", "long")}
    best_ceiling["single_p50_ms"] = min(c["single_p50_ms"] for c in ceilings)
    best_ceiling["peak_rss_mib"] = max(c["peak_rss_mib"] for c in ceilings)
    figures: dict[str, object] = {"dtype": info["dtype"], "ceiling": best_ceiling, "loads": {}}
    print(
        f"\n{dtype}: ceiling {best_ceiling['short']:.0f} short/s, {best_ceiling['long']:.0f} "
        f"long/s, one sentence p50 {best_ceiling['single_p50_ms']:.2f} ms, peak RSS "
        f"{best_ceiling['peak_rss_mib']:.0f} MiB"
    )
    for load in LOADS:
        load_runs = results[load.name]
        runs = [run.wrk for run in load_runs]
        best_run = max(load_runs, key=lambda r: r.wrk.rate)
        best = best_run.wrk
        errors = sum(r.bad + r.socket_errors for r in runs)
        texts_per_s = best.rate * load.inputs
        if load.ceiling == "single":
            p50 = min(r.p50_ms for r in runs)
            ratio = p50 / best_ceiling["single_p50_ms"]
            figure = f"p50 {p50:.2f} ms ({ratio:.2f}x the in-process call)"
        else:
            ratio = texts_per_s / best_ceiling[load.ceiling]
            figure = f"{texts_per_s:.0f} texts/s ({ratio:.2f}x the ceiling)"
        print(
            f"  {load.name:13} {figure}; {best.rate:.0f} req/s, p50 {best.p50_ms:.1f} ms, "
            f"p99 {best.p99_ms:.1f} ms; errors {errors}; peak RSS {rss[load.name]:.0f} MiB; "
            f"wrk used {best.client_cores:.2f} cores"
        )
        print(
            f"    server CPU per text: front ends' event loops {best_run.frontend_loop_ms:.2f} "
            f"ms, their other threads {best_run.frontend_other_ms:.2f} ms; engines "
            f"{best_run.engine_ms:.2f} ms"
        )
        print(
            f"    {best_run.batch_inputs:.1f} inputs per batch, {best_run.padding:.0%} padding; "
            f"forward passes {best_run.busy:.0%} of the time"
        )
        if errors:
            print(f"    first bad answer: {next(r.first_bad for r in runs if r.first_bad)}")
        figures["loads"][load.name] = {  # type: ignore[index]
            "texts_per_s": texts_per_s,
            "ratio": ratio,
            "errors": errors,
            "peak_rss_mib": rss[load.name],
            "runs": [asdict(r) for r in load_runs],
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="the ceiling's, and the server's unless several --devices",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU figures")
    parser.add_argument(
        "--model-id",
        help="the model folder, for the ceiling and the server (default: the default model)",
    )
    parser.add_argument(
        "--client-cores",
        default=WRK_CORE,
        help="the CPUs wrk runs on, a thread on each (taskset's list): more than one where one "
        "core cannot drive the server, as on a GPU machine",
    )
    parser.add_argument(
        "--no-prepack",
        dest="prepack",
        action="store_false",
        help="the ceiling and the server on F.linear, not prepacked weights (model/prepacked.py)",
    )
    parser.add_argument("--ceiling-of", help=argparse.SUPPRESS)
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    if args.ceiling_of:
        print(json.dumps(ceiling(args.ceiling_of, args)))
        return
    report = {dtype: benchmark(dtype, args) for dtype in args.dtypes}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
