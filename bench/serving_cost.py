"""The server's CPU per request outside the model, against the floor of a Python front end.

In one run, rounds alternating the two, each round a fresh process pinned to a core of its
own (taskset; wrk on another, as bench/wrk.py pins it):
1. The floor (bench/floor_app.py): a raw ASGI app under uvicorn (uvloop, httptools) doing
   only what no Python front end can skip per POST /embed: read the body, parse it with
   orjson, tokenize the input once, write a fixed vector of 32 floats with orjson.
2. The server (`python -m app --devices cpu --dtype float32 --threads 1`, plus the flags
   after --) on a tiny random model (BERT, 1 layer, hidden 32, 2 heads) with the default
   model's tokenizer, so that its forward passes cost little beside everything around them.
Each takes 32 wrk connections of one short sentence per request for --seconds after 2 s of
warm-up. Its CPU per request is the utime + stime of its whole process tree (the started
process and all its descendants, from /proc) over the measured run, over the requests wrk
completed; each keeps its best round (the lowest CPU per request), and server/floor is what
the server spends beyond the floor. When the server runs its engine in processes of its own
(named embed-engine), their CPU per input outside the forward passes (whose CPU time /metrics
gives) is printed too. Under either placement, so are the forward passes' CPU per input in the
server and that of the same tiny model's passes run by themselves right after each server
round, in this process pinned to the server's core, on batches of the server's mean size:
what running beside the front ends on one core adds to a pass. With --against REVISION, that
revision's server (from a temporary git worktree, as bench.side_by_side serves it) takes its
turn in every round as well, so that two builds' costs are compared within one run. All is
written to bench/results/serving_cost.json.
Usage: python -m bench.serving_cost [--seconds 8] [--rounds 2] [--port N] [--against REV]
                                    [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from bench.side_by_side import checkout, turns
from bench.workload import short_sentences
from bench.wrk import ENGINE_NAME, WRK_CORE, Server, WrkResult, free_port, run_wrk
from model import Embedder
from model.architectures import config_from_hf
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir

RESULTS = Path(__file__).resolve().parent / "results" / "serving_cost.json"
CONNECTIONS = 32
WARM_UP_SECONDS = 2
DIMENSION = 32
# The forward passes' CPU time, not their duration: pinned to one core beside the front ends,
# a pass's duration includes the time it waited for that core.
FORWARD_SECONDS = "embed_forward_cpu_seconds_total"
INPUTS = "embed_inputs_total"
BATCHES = "embed_batch_size_count"
# Texts the forward passes run on alone, after each server round (batches of the server's mean
# size), and the batches run once before, untimed.
ALONE_TEXTS = 2048
ALONE_WARM_UP_BATCHES = 4
# The default model's tokenizer and its settings (sentence_bert_config.json: its truncation),
# so that the tiny model tokenizes as the default does.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
    "sentence_bert_config.json",
)
TINY_CONFIG: dict[str, Any] = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": DIMENSION,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 512,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "type_vocab_size": 2,
    "pad_token_id": 0,
}
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


def make_tiny_model(folder: Path) -> Path:
    """A sentence-transformers folder (mean pooling, Normalize) with random BERT weights."""
    source = resolve_model_dir(DEFAULT_MODEL_ID, allow_download=False)
    folder.mkdir(parents=True, exist_ok=True)
    for name in COPIED_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    vocab_size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    raw = {**TINY_CONFIG, "vocab_size": vocab_size}
    torch.manual_seed(0)
    network = config_from_hf(raw).build()
    # Every weight random, LayerNorms included, as tests/helpers.py makes its checkpoints.
    state = {key: torch.randn_like(value) * 0.5 for key, value in network.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "modules.json").write_text(json.dumps(MODULES))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": DIMENSION, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


class Pinned(Server):
    """bench.wrk.Server's waiting and stopping, for any command on a given port: Server's own
    start runs `python -m app` on a port it picks, with nothing before it (no taskset)."""

    def __init__(self, command: Sequence[str], port: int, source: Path | None = None) -> None:
        self.port = port
        self.engines = 1
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            list(command), env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=source
        )


def server_core() -> int | None:
    """The core the server and the floor are pinned to: one other than wrk's; None if this
    machine lends only one core."""
    others = sorted(os.sched_getaffinity(0) - {int(WRK_CORE)})
    return others[0] if others else None


def pinning() -> list[str]:
    """taskset to `server_core`, whose children (the whole tree) inherit it; none if this
    machine lends only one core."""
    core = server_core()
    if core is None:
        print("note: only one CPU: the server and the floor are not pinned, and share it with wrk")
        return []
    return ["taskset", "-c", str(core)]


@dataclass(frozen=True)
class Proc:
    ppid: int
    name: str  # as /proc/PID/comm shows it
    cpu_seconds: float  # utime + stime, over all its threads


def processes() -> dict[int, Proc]:
    """Every process on the machine, from /proc/PID/stat (fields 4, 2, 14 and 15)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        head, _, tail = text.rpartition(")")  # the name may hold spaces and parentheses
        fields = tail.split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        found[int(stat.parent.name)] = Proc(int(fields[1]), head.partition("(")[2], cpu)
    return found


def tree(root: int) -> dict[int, Proc]:
    """`root` and all its descendants, by their parent links."""
    everyone = processes()
    children: dict[int, list[int]] = {}
    for pid, proc in everyone.items():
        children.setdefault(proc.ppid, []).append(pid)
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in everyone:
            found[pid] = everyone[pid]
            frontier += children.get(pid, [])
    return found


def cpu_delta(before: dict[int, Proc], after: dict[int, Proc], pids: Sequence[int]) -> float:
    """CPU seconds `pids` used in between; one started in between counts from zero (one that
    exited is lost: its time went to its parent's cutime only if reaped)."""
    return sum(
        after[pid].cpu_seconds - (before[pid].cpu_seconds if pid in before else 0.0) for pid in pids
    )


def metric_sums(url: str) -> dict[str, float]:
    """The forward passes' CPU seconds, the inputs embedded and the batches, summed over any
    label sets."""
    sums = dict.fromkeys((FORWARD_SECONDS, INPUTS, BATCHES), 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.partition("{")[0]
        if name in sums:
            sums[name] += float(value)
    return sums


@dataclass(frozen=True)
class Engine:
    """The embed-engine processes' CPU over a run, and the forward passes' share of it."""

    processes: int
    cpu_seconds: float
    forward_seconds: float  # CPU time; with --threads 1 a pass runs on one thread
    inputs: float

    @property
    def us_per_input(self) -> float:
        return (self.cpu_seconds - self.forward_seconds) / max(self.inputs, 1) * 1e6


@dataclass(frozen=True)
class Passes:
    """The server's forward passes over a run (CPU time, whichever process runs them), and the
    same tiny model's passes on batches of their mean size run alone on the server's core just
    after: what a pass costs beside the front ends against what it costs by itself."""

    cpu_seconds: float
    inputs: float
    mean_batch: float
    alone_us_per_input: float

    @property
    def us_per_input(self) -> float:
        return self.cpu_seconds / max(self.inputs, 1) * 1e6


class PassesAlone:
    """The tiny model's forward passes in this process, pinned to the server's core (this
    process's own cores given back after), on one torch thread as the server runs them."""

    def __init__(self, model: Path, texts: Sequence[str], core: int | None) -> None:
        self.embedder = Embedder.load(str(model), device="cpu", dtype="float32")
        self.texts = list(texts)[:ALONE_TEXTS]
        self.core = core

    def us_per_input(self, batch_size: int) -> float:
        """Thread CPU per input over the texts in batches of `batch_size`."""
        batches = [
            self.embedder.tokenize(self.texts[first : first + batch_size])
            for first in range(0, len(self.texts), batch_size)
        ]
        own_cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
        if self.core is not None:
            os.sched_setaffinity(0, {self.core})
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                for batch in batches[:ALONE_WARM_UP_BATCHES]:
                    self.embedder.forward(batch)
                started = time.thread_time()
                for batch in batches:
                    self.embedder.forward(batch)
                seconds = time.thread_time() - started
        finally:
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, own_cores)
        return seconds / len(self.texts) * 1e6


@dataclass(frozen=True)
class Round:
    wrk: WrkResult
    cpu_seconds: float  # the whole process tree's
    engine: Engine | None
    passes: Passes | None  # a server's, not the floor's

    @property
    def us_per_request(self) -> float:
        return self.cpu_seconds / max(self.wrk.requests, 1) * 1e6

    def figures(self) -> dict[str, Any]:
        engine = self.engine and {**asdict(self.engine), "us_per_input": self.engine.us_per_input}
        passes = self.passes and {**asdict(self.passes), "us_per_input": self.passes.us_per_input}
        return {
            "requests_per_s": self.wrk.rate,
            "cpu_us_per_request": self.us_per_request,
            "cpu_seconds": self.cpu_seconds,
            "wrk": asdict(self.wrk),
            "engine": engine,
            "passes": passes,
        }


def load(url: str, bodies: Sequence[str], seconds: float) -> WrkResult:
    return run_wrk(
        url, bodies, connections=CONNECTIONS, seconds=seconds, vectors=1, dimension=DIMENSION
    )


def measure(
    target: Pinned, bodies: Sequence[str], seconds: float, alone: PassesAlone | None
) -> Round:
    """One load's figures; `alone` (a server's round, not the floor's) runs the passes by
    themselves after it."""
    load(target.url, bodies, WARM_UP_SECONDS)  # a fresh process's first seconds are slower
    # /metrics is read outside the CPU readings, so that its own requests do not count.
    metrics = metric_sums(target.url) if alone else {}
    before = tree(target.process.pid)
    result = load(target.url, bodies, seconds)
    after = tree(target.process.pid)
    if alone is None:
        return Round(result, cpu_delta(before, after, list(after)), None, None)
    metrics_after = metric_sums(target.url)
    ran = {name: metrics_after[name] - metrics[name] for name in metrics}
    engine = None
    engines = [pid for pid, proc in after.items() if proc.name == ENGINE_NAME]
    if engines:
        engine = Engine(
            len(engines), cpu_delta(before, after, engines), ran[FORWARD_SECONDS], ran[INPUTS]
        )
    mean_batch = ran[INPUTS] / max(ran[BATCHES], 1)
    alone_us = alone.us_per_input(max(1, round(mean_batch)))
    passes = Passes(ran[FORWARD_SECONDS], ran[INPUTS], mean_batch, alone_us)
    return Round(result, cpu_delta(before, after, list(after)), engine, passes)


@dataclass(frozen=True)
class Target:
    name: str
    command: list[str]
    port: int
    server: bool  # the floor has no /metrics
    source: Path | None = None  # the checkout it runs from; None: this one


def run_round(target: Target, bodies: Sequence[str], seconds: float, alone: PassesAlone) -> Round:
    """A fresh process: this machine's speed drifts, and one process's speed is a draw."""
    process = Pinned(target.command, target.port, target.source)
    try:
        process.wait_ready()
        return measure(process, bodies, seconds, alone if target.server else None)
    finally:
        process.stop()


def targets(
    model: Path, port: int, extra: Sequence[str], against: tuple[str, Path] | None = None
) -> list[Target]:
    """The floor and the server, each under taskset, on the same port in turn; and, given
    `against` (a revision and its checkout), that revision's server."""
    pin = pinning()
    floor = [sys.executable, "-m", "bench.floor_app", "--tokenizer", str(model / "tokenizer.json")]
    server = [sys.executable, "-m", "app", "--model-id", str(model), "--devices", "cpu"]
    server += ["--dtype", "float32", "--threads", "1", "--host", "127.0.0.1"]
    server += ["--log-level", "warning"]
    found = [
        Target("floor", [*pin, *floor, "--port", str(port)], port, server=False),
        Target("server", [*pin, *server, "--port", str(port), *extra], port, server=True),
    ]
    if against is not None:
        revision, source = against  # `python -m app` there imports that checkout's code
        found.append(Target(f"server at {revision}", found[1].command, port, True, source))
    return found


def describe(name: str, best: Round, rounds: Sequence[Round]) -> None:
    errors = sum(r.wrk.bad + r.wrk.socket_errors for r in rounds)
    print(
        f"{name:6} {best.wrk.rate:7.0f} req/s, {best.us_per_request:6.1f} µs of CPU per request "
        f"(best of {len(rounds)}; p50 {best.wrk.p50_ms:.1f} ms; errors {errors})"
    )
    first_bad = next((r.wrk.first_bad for r in rounds if r.wrk.first_bad), "")
    if first_bad:
        print(f"       first bad answer: {first_bad}")


def describe_engine(engine: Engine | None) -> None:
    if engine is None:
        print("the engine runs inside the front end (in-process placement): no engine figure")
        return
    print(f"engine CPU per input outside forward passes: {engine.us_per_input:.1f} µs")


def describe_passes(passes: Passes | None) -> None:
    if passes is None:
        return
    print(
        f"forward passes: {passes.us_per_input:.1f} µs of CPU per input in the server "
        f"(mean batch {passes.mean_batch:.1f}), {passes.alone_us_per_input:.1f} µs alone "
        f"on its core ({passes.us_per_input / passes.alone_us_per_input:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, help="the floor's and the server's, in turn")
    parser.add_argument("--against", metavar="REVISION", help="a git revision's server too")
    parser.add_argument("server", nargs="*", help="after --, flags for the server")
    args = parser.parse_args()
    if shutil.which("wrk") is None:  # before the model is made
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    texts = short_sentences(4096, seed=5)
    bodies = [orjson.dumps({"inputs": text}).decode() for text in texts]
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        model = make_tiny_model(Path(folder) / "tiny")
        alone = PassesAlone(model, texts, server_core())
        against = None
        if args.against:
            against = (args.against, stack.enter_context(checkout(args.against)))
        every = targets(model, args.port or free_port(), args.server, against)
        rounds: dict[str, list[Round]] = {target.name: [] for target in every}
        for round_index in range(args.rounds):  # alternating, so that drift hits all alike
            for target in turns(every, round_index):
                rounds[target.name].append(run_round(target, bodies, args.seconds, alone))
    report(rounds, every, args)


def report(rounds: dict[str, list[Round]], every: list[Target], args: argparse.Namespace) -> None:
    best = {name: min(runs, key=lambda r: r.us_per_request) for name, runs in rounds.items()}
    for name, runs in rounds.items():
        describe(name, best[name], runs)
    ratios: dict[str, float] = {}
    for server in (target.name for target in every if target.server):
        ratios[server] = best[server].us_per_request / best["floor"].us_per_request
        print(f"{server}/floor CPU per request: {ratios[server]:.2f}x")
        describe_engine(best[server].engine)
        describe_passes(best[server].passes)
    figures: dict[str, Any] = {
        "seconds": args.seconds,
        "connections": CONNECTIONS,
        "server_flags": args.server,
        "against": args.against,
        "server_over_floor": ratios,
    }
    for target in every:
        figures[target.name] = {
            "command": target.command,
            "best": best[target.name].figures(),
            "rounds": [r.figures() for r in rounds[target.name]],
        }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
