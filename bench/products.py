"""The encoder's linear products alone, on each float32 kernel, against ONNX Runtime's MatMul.

A float32 pass of the default model (all-MiniLM-L6-v2) spends most of its time in its linear
products, so this is where a CPU's float32 figures against ONNX Runtime
(`bench.onnx_compare`) are decided. Every linear layer of the default model's encoder is run
alone, in the model's order, each on an input of random rows of its own width (the products
are not chained: there is no attention between them), on each kernel model/prepacked.py
knows: oneDNN's on its prepacked weight, MKL's on its packed weight (where torch has MKL),
and torch's `F.linear`, whatever the encoder's own choice on this CPU (printed). ONNX Runtime
runs the same weights and biases as one graph of MatMul and Add nodes, on the same inputs and
threads, one node at a time (it may order independent nodes its own way).
Every engine's outputs are first compared with `F.linear`'s: float32's must agree to their
rounding; int8's worst error (relative norm of the difference, on these random inputs) is
printed. Each set is timed on 1, 16 (one sentence), 32 and 512 rows (a batch), in rounds that
rotate the order of the engines, each engine's median call per round and its best round
kept; each ratio is a kernel's time over ONNX Runtime's. `--dtype int8` runs the products as
`--dtype int8` does (model/int8.py: fbgemm, activations quantized per call) against ONNX
Runtime's `quantize_dynamic` of the same graph, as bench.onnx_compare quantizes the model.
Needs the bench extra (onnxruntime, onnx); not in CI.
Usage: python -m bench.products [--dtype float32|int8] [--threads 2] [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.onnx_compare import quantize, session
from bench.side_by_side import turns
from model import DEFAULT_MODEL_ID, Embedder
from model.device import cpu_flags
from model.int8 import Int8Linear, weight_levels
from model.prepacked import MklLinear, OnednnLinear, packed_twin

RESULTS = Path(__file__).resolve().parent / "results" / "products.json"
ROWS = (1, 16, 32, 512)
# Float32 kernels differ from F.linear by rounding; a weight laid out wrong, by its whole size.
FLOAT32_ERROR = 1e-4
Run = Callable[[], list[np.ndarray]]


def encoder_linears(embedder: Embedder) -> list[nn.Linear]:
    """The linear layers of an encoder loaded with prepack=False, in the order of its
    modules: for BERT the order of a pass."""
    return [m for m in embedder.network.modules() if isinstance(m, nn.Linear)]


def float_weights(linears: list[nn.Linear]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(in x out weight, bias) of each layer, as ONNX's MatMul and Add take them."""
    found = []
    for layer in linears:
        weight = layer.weight.detach().numpy().T.copy()
        if layer.bias is None:
            bias = np.zeros(layer.out_features, np.float32)
        else:
            bias = layer.bias.detach().numpy()
        found.append((weight, bias))
    return found


Feeds = dict[int, np.ndarray]  # an input of its width for each product


def onnx_products(
    weights: list[tuple[np.ndarray, np.ndarray]], threads: int, int8: bool
) -> Callable[[Feeds], Run]:
    """A session of one MatMul and Add per product, in order (quantized by ONNX Runtime's
    `quantize_dynamic` for int8, as bench.onnx_compare quantizes the model), and a factory
    of its runs."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, initializers, outputs = [], [], []
    widths = sorted({weight.shape[0] for weight, _ in weights})
    for index, (weight, bias) in enumerate(weights):
        initializers += [
            numpy_helper.from_array(weight, f"w{index}"),
            numpy_helper.from_array(bias, f"b{index}"),
        ]
        source = f"x{weight.shape[0]}"
        nodes.append(helper.make_node("MatMul", [source, f"w{index}"], [f"p{index}"]))
        nodes.append(helper.make_node("Add", [f"p{index}", f"b{index}"], [f"y{index}"]))
        outputs.append(helper.make_tensor_value_info(f"y{index}", TensorProto.FLOAT, None))
    inputs = [
        helper.make_tensor_value_info(f"x{width}", TensorProto.FLOAT, ["rows", width])
        for width in widths
    ]
    graph = helper.make_graph(nodes, "products", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "products.onnx"
        path.write_bytes(model.SerializeToString())
        if int8:
            path = quantize(path, Path(work) / "products-int8.onnx")
        runs = session(path, threads)

    def run(feeds: Feeds) -> Run:
        named = {f"x{width}": feeds[width] for width in widths}
        return lambda: runs.run(None, named)

    return run


def median_ms(run: Callable[[], object], calls: int) -> float:
    """The median of `calls` calls, each timed alone, in ms, after one untimed call."""
    run()  # a first call per row count compiles, for oneDNN
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1000


def kernels(linears: list[nn.Linear], int8: bool) -> dict[str, list[nn.Module]]:
    """The same layers on each float32 kernel this torch build has, or in int8 as the encoder
    runs them on this CPU."""
    if int8:
        levels = weight_levels(cpu_flags())
        return {"int8 (fbgemm)": [Int8Linear(layer, levels) for layer in linears]}
    found: dict[str, list[nn.Module]] = {"oneDNN": [OnednnLinear(layer) for layer in linears]}
    mkl = torch.backends.mkl.is_available()  # type: ignore[no-untyped-call]
    if mkl and torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        found["MKL"] = [MklLinear(layer) for layer in linears]
    found["F.linear"] = list(linears)
    return found


def outputs(layers: list[nn.Module], inputs: list[torch.Tensor]) -> list[np.ndarray]:
    """Each layer on its input, in order."""
    with torch.inference_mode():
        return [layer(x).numpy() for layer, x in zip(layers, inputs, strict=True)]


def on_kernel(layers: list[nn.Module], inputs: list[torch.Tensor]) -> Run:
    return lambda: outputs(layers, inputs)


def worst_error(outputs: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """The largest relative difference (norm of the difference over the norm) of an engine's
    products from F.linear's."""
    return max(
        float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
        for got, expected in zip(outputs, reference, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=("float32", "int8"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    int8 = args.dtype == "int8"
    plain = Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype="float32", prepack=False)
    linears = encoder_linears(plain)
    onnx = onnx_products(float_weights(linears), args.threads, int8)
    on_each = kernels(linears, int8)
    if int8:
        choice = f"int8, weights within +-{weight_levels(cpu_flags())}"
    else:  # what prepack_linears would swap each layer for
        twins = {type(twin).__name__ for twin in map(packed_twin, linears) if twin is not None}
        choice = ", ".join(sorted(twins)) or "F.linear"
    print(
        f"{len(linears)} linear products of {DEFAULT_MODEL_ID}, {args.dtype}, {args.threads} "
        f"threads; the encoder runs them here on: {choice}"
    )
    generator = np.random.default_rng(0)
    widths = {layer.in_features for layer in linears}
    report = {}
    for rows in ROWS:
        feeds = {w: generator.standard_normal((rows, w), dtype=np.float32) for w in widths}
        inputs = [torch.from_numpy(feeds[layer.in_features]) for layer in linears]
        runs = {name: on_kernel(layers, inputs) for name, layers in on_each.items()}
        runs["onnxruntime"] = onnx(feeds)
        reference = outputs(list(linears), inputs)
        errors = {name: worst_error(run(), reference) for name, run in runs.items()}
        if not int8 and max(errors.values()) > FLOAT32_ERROR:
            raise SystemExit(f"an engine's products differ from F.linear's: {errors}")
        best = dict.fromkeys(runs, float("inf"))
        for round_index in range(args.rounds):
            for name in turns(list(runs), round_index):
                best[name] = min(best[name], median_ms(runs[name], args.calls))
        report[rows] = {"ms": best, "worst_error": errors}
        figures = ", ".join(
            f"{name} {ms:.2f} ms ({ms / best['onnxruntime']:.2f}x)" for name, ms in best.items()
        )
        print(f"{rows:4d} rows: {figures}")
        if int8:
            print(
                "   worst product's error: " + ", ".join(f"{n} {e:.3f}" for n, e in errors.items())
            )
    RESULTS.parent.mkdir(exist_ok=True)
    summary = {"dtype": args.dtype, "threads": args.threads, "rows": report}
    RESULTS.write_text(json.dumps(summary, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
