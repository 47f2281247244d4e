"""What each CUDA call of a graphed pass costs the host thread, in a tight loop (a GPU only).

The calls `model/cuda_graphs.py` makes per pass, at a pass's sizes (a bucket of 8 x 32 input
ids, 8 vectors of 384 back), each repeated after a warm-up, in rounds, with the stream
drained between rounds; the best and the median round are printed, in microseconds per
call. Alternatives sit beside the call the code makes: memory registered with
`cudaHostRegister` against torch's pinned memory, a copy back into a buffer made once
against `.to("cpu")`. Inside a server the same calls cost several times as much (caches and
clocks cold after whatever ran before them, docs/benchmarks.md): compare them with each other,
not with a pass.
Usage: python -m bench.cuda_calls [--calls 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.server import DIMENSION

ROWS, WIDTH = 8, 32
# The graph replayed: as many small kernels as a small encoder's pass launches.
GRAPH_KERNELS = 200


def timed(call: Callable[[], object], calls: int, rounds: int) -> tuple[float, float]:
    """The best and median round's microseconds per call."""
    for _ in range(calls // 4):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - started) / calls * 1e6)
        torch.cuda.synchronize()  # the queue drained: the next round's calls never wait on it
    return min(per_call), statistics.median(per_call)


def graphed(vectors: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A captured graph of GRAPH_KERNELS elementwise kernels on `vectors`."""

    def body(values: torch.Tensor) -> torch.Tensor:
        for _ in range(GRAPH_KERNELS // 2):
            values = values * 1.0001 + 0.5
        return values

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(vectors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(vectors)
    return graph


def pass_calls() -> dict[str, Callable[[], object]]:
    device = torch.device("cuda")
    values = 2 * ROWS * WIDTH + ROWS  # ids, mask and prompt lengths, laid one after another
    on_gpu = torch.empty(values, dtype=torch.int64, device=device)
    pinned = torch.empty(values, dtype=torch.int64, pin_memory=True)
    registered = np.zeros(values, dtype=np.int64)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = cudart.cudaHostRegister(registered.ctypes.data, registered.nbytes, 0)
    if int(code) != 0:
        raise SystemExit(f"cudaHostRegister failed: {code}")
    from_numpy = torch.from_numpy(registered)
    vectors = torch.randn(64, DIMENSION, device=device)
    made_once = torch.empty(64, DIMENSION, pin_memory=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    graph = graphed(torch.randn(ROWS, DIMENSION, device=device))
    return {
        "inputs to the GPU, from torch's pinned memory": lambda: on_gpu.copy_(
            pinned, non_blocking=True
        ),
        "inputs to the GPU, from memory cudaHostRegister'd": lambda: on_gpu.copy_(
            from_numpy, non_blocking=True
        ),
        'vectors back, .to("cpu", non_blocking=True)': lambda: vectors[:ROWS].to(
            "cpu", non_blocking=True
        ),
        "vectors back, into a pinned buffer made once": lambda: made_once[:ROWS].copy_(
            vectors[:ROWS], non_blocking=True
        ),
        "Event.record": event.record,
        "Event.query": event.query,
        f"CUDAGraph.replay, {GRAPH_KERNELS} kernels": graph.replay,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=400, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, call in pass_calls().items():
        best, median = timed(call, args.calls, args.rounds)
        print(f"{name:52} best {best:6.2f} µs, median {median:6.2f} µs per call")


if __name__ == "__main__":
    main()
