"""The real server against the in-process ceiling of this project's own encoder, per dtype.

In one run, for each dtype and round:
1. The ceiling, in a child process kept for the round: the encoder on the same texts,
   tokenization included, sorted by length, in batches of 32, for short sentences and long
   passages; and the p50 of single-sentence calls (tokenize, forward, pool).
2. A fresh real server (`python -m app`, loopback) under wrk on --client-cores: 1 x 1, 32 x 1,
   4 x 32 and 256 x 1 short sentences, and 32 x 1 long passages (clients x inputs per request),
   every response checked (status, vector count, dimension). Just before and just after each
   load, while the server is idle, the ceiling process measures that load's figure again on a
   quarter of its texts (over and over for at least a second), and the load's ratio is to the
   mean of the two: this machine's speed drifts by tens of percent from one minute to the next.
Each load keeps the round whose ratio is best, printed with every round's. Each figure comes
with the ceiling around it, the server's peak RSS, where its CPU went (per text, by role: the
front ends' event loops and other threads, the engines), its batches (size, padding) and the
share of the time its forward passes ran, which tell why a figure falls short of the ceiling;
all is printed and written to bench/results/server.json.
Usage: python -m bench.server [--dtypes float32 bfloat16 int8] [--seconds 10] [--rounds 2]
                              [--device cpu|cuda] [--model-id ID] [--client-cores 0-3]
                              [--compile] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from bench.workload import long_passages, short_sentences
from bench.wrk import WRK_CORE, Server, WrkResult, engines_in, peak_kib, run_wrk
from model import DEFAULT_MODEL_ID

RESULTS = Path(__file__).resolve().parent / "results" / "server.json"
BATCH = 32
DIMENSION = 384  # the default model's
# The figures that bracket each load run on every fourth of the ceiling's texts, over and over
# for at least this long (a GPU goes through them in milliseconds): within the load's minute.
BRACKET_SHARE = 4
BRACKET_SECONDS = 1.0


@dataclass(frozen=True)
class Load:
    name: str
    clients: int
    inputs: int  # per request
    long: bool
    ceiling: str  # the ceiling figure it is compared with: "short", "long" or "single"

    @property
    def figure(self) -> str:
        """The name of that figure in the ceiling's answers."""
        return "single_p50_ms" if self.ceiling == "single" else self.ceiling


LOADS = (
    Load("1 x 1 short", 1, 1, False, "single"),
    Load("32 x 1 short", 32, 1, False, "short"),
    Load("4 x 32 short", 4, 32, False, "short"),
    Load("32 x 1 long", 32, 1, True, "long"),
    # Many clients at once, as a GPU behind a fleet of callers sees them.
    Load("256 x 1 short", 256, 1, False, "short"),
)


def reference(dtype: str, args: argparse.Namespace) -> None:
    """Run in a child process, kept for a round: the encoder loaded once, then one JSON line
    of figures for each command read from stdin. "full": texts/s for short and long, the
    single-call p50 and the peak RSS; "short", "long" or "single": that figure alone, on every
    `BRACKET_SHARE`-th text, repeated for at least `BRACKET_SECONDS` (asked just before and
    just after each load). Anything else printed goes to stderr: stdout carries answers only."""
    import torch

    from model import Embedder

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(args.threads)
    embedder = Embedder.load(
        args.model_id or DEFAULT_MODEL_ID,
        device=args.device,
        dtype=dtype,
        prepack=args.prepack,
        compile=args.compile,
    )
    # As the server does at start-up: the compiled passes (--compile), the CUDA graphs (a GPU).
    embedder.compile_passes()
    embedder.capture_graphs()
    ordered = {
        "short": sorted(short_sentences(2048), key=len),
        "long": sorted(long_passages(256), key=len),
    }
    singles = short_sentences(300, seed=2)

    def rate(name: str, share: int, at_least: float) -> float:
        texts = ordered[name][::share]
        batches = [texts[start : start + BATCH] for start in range(0, len(texts), BATCH)]
        # A first pass untimed: on a GPU each new eager shape pays for choosing its kernels
        # once, several times the cost of a pass with its kernels chosen.
        for batch in batches:
            embedder.embed(batch)
        passes, started = 0, time.perf_counter()
        while passes == 0 or time.perf_counter() - started < at_least:
            for batch in batches:
                embedder.embed(batch)
            passes += 1
        return passes * len(texts) / (time.perf_counter() - started)

    def single_p50_ms(share: int, at_least: float) -> float:
        calls = singles[::share]
        for sentence in calls[: len(calls) // 6]:  # a warm-up
            embedder.embed([sentence])
        times: list[float] = []
        started = time.perf_counter()
        while not times or time.perf_counter() - started < at_least:
            for sentence in calls:
                call_started = time.perf_counter()
                embedder.embed([sentence])
                times.append(time.perf_counter() - call_started)
        return statistics.median(times) * 1000

    for request in sys.stdin:
        command = request.strip()
        if command == "full":
            figures = {
                "short": rate("short", 1, 0),
                "long": rate("long", 1, 0),
                "single_p50_ms": single_p50_ms(1, 0),
                "peak_rss_mib": peak_kib(os.getpid()) / 1024,  # after the passes, which count
            }
        elif command == "single":
            figures = {"single_p50_ms": single_p50_ms(BRACKET_SHARE, BRACKET_SECONDS)}
        else:
            figures = {command: rate(command, BRACKET_SHARE, BRACKET_SECONDS)}
        print(json.dumps(figures), file=answers, flush=True)


class Reference:
    """The ceiling's child process (`reference`) for one round: idle on its stdin while the
    server is measured, and measured itself only while the server is idle."""

    def __init__(self, dtype: str, args: argparse.Namespace) -> None:
        command = [
            sys.executable, "-m", "bench.server", "--reference-of", dtype,
            "--threads", str(args.threads), "--device", args.device,
            *(["--model-id", args.model_id] if args.model_id else []),
            *([] if args.prepack else ["--no-prepack"]),
            *(["--compile"] if args.compile else []),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, command: str) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it has exited: said below
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the ceiling's process exited ({self.process.wait()})")
        figures: dict[str, float] = json.loads(line)
        return figures

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """Its stdin closed, it exits; after a failure, or if it does not, it is killed."""
        if kind is not None:
            self.process.kill()
        try:
            self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
        if kind is None and self.process.returncode != 0:
            raise SystemExit(f"the ceiling's process failed ({self.process.returncode})")


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


@dataclass(frozen=True)
class Bracketed:
    """A load's run, and the ceiling's same figure just before and just after it."""

    run: LoadRun
    before: float
    after: float

    def ratio(self, load: Load) -> float:
        """The server's figure over the ceiling's around it: texts/s over texts/s, or for
        a single sentence, p50 over p50."""
        reference = (self.before + self.after) / 2
        if load.ceiling == "single":
            return self.run.wrk.p50_ms / reference
        return self.run.wrk.rate * load.inputs / reference


def best_round(load: Load, rounds: list[Bracketed]) -> Bracketed:
    """The round whose ratio to its own bracket is best: the lowest p50 ratio for a single
    sentence, the highest texts/s ratio otherwise. Of a few noisy rounds the best leans
    high, so every round's ratio is printed beside it."""
    choose = min if load.ceiling == "single" else max
    return choose(rounds, key=lambda bracketed: bracketed.ratio(load))


def benchmark(dtype: str, args: argparse.Namespace) -> dict[str, object]:
    ceilings = []
    results: dict[str, list[Bracketed]] = {load.name: [] for load in LOADS}
    rss: dict[str, float] = {}
    flags = ["--dtype", dtype, *(["--model-id", args.model_id] if args.model_id else [])]
    if engines_in(args.server) == 1:
        flags += ["--devices", args.device, "--threads", str(args.threads)]
    # Else each engine's threads are the server's default, its share of the CPUs: the
    # ceiling's threads in every engine would oversubscribe them (see Settings).
    flags += args.server + ([] if args.prepack else ["--no-prepack"])
    flags += ["--compile"] if args.compile else []
    info: dict[str, object] = {}
    for _ in range(args.rounds):
        # A fresh server each round: one process's speed is a draw of its own (one process's
        # 1 x 1 p50 differs from the next's by more than most changes). The ceiling runs
        # alone first, then again around each load, while the server is idle.
        with Reference(dtype, args) as reference:
            ceilings.append(reference.ask("full"))
            server = Server(flags)
            try:
                server.wait_ready()
                info = server.info()
                dimension = int(str(info["dimensions"]))
                for load in LOADS:  # warm-up: the first seconds of a fresh server are slower
                    run_load(server, load, 2, args.client_cores, dimension)
                for load in LOADS:
                    before = reference.ask(load.ceiling)[load.figure]
                    run = run_load(server, load, args.seconds, args.client_cores, dimension)
                    after = reference.ask(load.ceiling)[load.figure]
                    results[load.name].append(Bracketed(run, before, after))
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
        bracketed = results[load.name]
        single = load.ceiling == "single"
        chosen = best_round(load, bracketed)
        best_run, best = chosen.run, chosen.run.wrk
        ratio = chosen.ratio(load)
        ratios = [b.ratio(load) for b in bracketed]
        errors = sum(b.run.wrk.bad + b.run.wrk.socket_errors for b in bracketed)
        texts_per_s = best.rate * load.inputs
        if single:
            figure = f"p50 {best.p50_ms:.2f} ms ({ratio:.2f}x the in-process call"
            around = f"{chosen.before:.2f}, {chosen.after:.2f} ms"
        else:
            figure = f"{texts_per_s:.0f} texts/s ({ratio:.2f}x the ceiling"
            around = f"{chosen.before:.0f}, {chosen.after:.0f} {load.ceiling}/s"
        print(
            f"  {load.name:13} {figure} around it: {around}; each round "
            f"{', '.join(f'{r:.2f}x' for r in ratios)}); {best.rate:.0f} req/s, p50 "
            f"{best.p50_ms:.1f} ms, p99 {best.p99_ms:.1f} ms; errors {errors}; peak RSS "
            f"{rss[load.name]:.0f} MiB; wrk used {best.client_cores:.2f} cores"
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
            first_bad = next(b.run.wrk.first_bad for b in bracketed if b.run.wrk.first_bad)
            print(f"    first bad answer: {first_bad}")
        figures["loads"][load.name] = {  # type: ignore[index]
            "texts_per_s": texts_per_s,
            "p50_ms": best.p50_ms,
            "ratio": ratio,
            "ceiling_around": [chosen.before, chosen.after],
            "errors": errors,
            "peak_rss_mib": rss[load.name],
            "runs": [{**asdict(b), "ratio": r} for b, r in zip(bracketed, ratios, strict=True)],
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
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the ceiling and the server on compiled passes (model/compiled.py), float32 and "
        "bfloat16 only",
    )
    parser.add_argument("--reference-of", help=argparse.SUPPRESS)
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    if args.reference_of:
        reference(args.reference_of, args)
        return
    report = {dtype: benchmark(dtype, args) for dtype in args.dtypes}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
