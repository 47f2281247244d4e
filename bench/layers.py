"""The encoder's CPU mechanisms, each forced on and off on the same batches.

- Packing: position-wise layers on real tokens only, at several shares of padding
  (this is what sets model.packing.PACKING_MIN_PADDING).
- Feed-forward chunks of model.packing.FEED_FORWARD_CHUNK tokens against the whole batch.
- Linear weights prepacked (model/prepacked.py) for MKL (float32) and for oneDNN (float32,
  and bfloat16 where the CPU runs it) against torch's `F.linear`, on one sentence and batches
  of 8 and 32; and one float32 layer of each of several sizes on each, on row counts that vary
  from call to call as a server's do (what model.prepacked's MIN_MKL_WEIGHTS and
  MIN_ONEDNN_FLOAT32_WEIGHTS were read from).
- What bounds one sentence's products: the model's float32 linear layers on 16 rows one after
  another as the model runs them, each alone with its weights hot in the caches, and the time
  to read all their weights once.
- Attention with no mask where a batch has no padding (one sentence always), against the
  same pass with its all-ones mask made and added, in each dtype this CPU runs.
Usage: python -m bench.layers [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch
from torch import nn

from bench.encoder import make_texts
from bench.workload import short_sentences
from model import DEFAULT_MODEL_ID, Embedder, Encoded, packing, prepacked
from model.attention import Mask
from model.device import resolve_dtype
from model.int8 import int8_unavailable
from model.packing import TokenLayout
from model.prepacked import MklLinear, OnednnLinear, can_prepack

PADDING_SHARES = (0.05, 0.10, 0.20, 0.40, 0.60)
# (in_features, out_features): small models' layers up to all-MiniLM-L6-v2's and BERT-base's.
LAYER_SIZES = ((32, 96), (128, 512), (256, 256), (384, 384), (512, 512), (384, 1536), (768, 3072))
# Row counts of one call: a few sentences' tokens, and a batch's.
ROW_RANGES = ((1, 40), (100, 600))
# The kernels each dtype's linear layers can run on; F.linear is the baseline.
KERNELS = {torch.float32: ("mkl", "onednn"), torch.bfloat16: ("onednn",)}


def padded_batch(share: float, count: int = 64, longest: int = 120) -> list[list[int]]:
    """Id lists whose padding, once padded to `longest`, is about `share` of the batch."""
    rng = random.Random(0)
    mean = (count * longest * (1 - share) - longest) / (count - 1)
    spread = min(longest - mean, mean - 3)  # symmetric, so the mean (and the share) holds
    lengths = [longest] + [
        round(rng.uniform(mean - spread, mean + spread)) for _ in range(count - 1)
    ]
    return [
        [101] + [2000 + (i * 7 + j) % 5000 for j in range(n - 2)] + [102]
        for i, n in enumerate(lengths)
    ]


def padding_of(batch: list[list[int]]) -> float:
    return 1 - sum(map(len, batch)) / (len(batch) * max(map(len, batch)))


def best_interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def with_setting(name: str, value: float, run: Callable[[], object]) -> Callable[[], object]:
    def wrapped() -> object:
        saved = getattr(packing, name)
        setattr(packing, name, value)
        try:
            return run()
        finally:
            setattr(packing, name, saved)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    embedder = Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype="float32")

    print(f"packing, batch 64 up to 120 tokens, {args.threads} threads, best of {args.repeats}")
    for share in PADDING_SHARES:
        batch = padded_batch(share)
        best = best_interleaved(
            {
                "packed": with_setting(
                    "PACKING_MIN_PADDING", 0.0, functools.partial(embedder.forward, batch)
                ),
                "grid": with_setting(
                    "PACKING_MIN_PADDING", 1.1, functools.partial(embedder.forward, batch)
                ),
            },
            args.repeats,
        )
        print(
            f"  padding {padding_of(batch):.2f}: packed {best['packed'] * 1000:.0f} ms, "
            f"grid {best['grid'] * 1000:.0f} ms, speed-up {best['grid'] / best['packed']:.2f}"
        )

    print(
        f"feed-forward in chunks of {packing.FEED_FORWARD_CHUNK} tokens against whole, "
        "equal-length ~200-token inputs"
    )
    for count in (32, 128):
        ids = [e.ids for e in embedder.tokenize(make_texts(190, count, count))]
        best = best_interleaved(
            {
                "chunked": functools.partial(embedder.forward, ids),
                "whole": with_setting(
                    "FEED_FORWARD_CHUNK", 10**9, functools.partial(embedder.forward, ids)
                ),
            },
            args.repeats,
        )
        print(
            f"  batch {count}: chunked {best['chunked'] * 1000:.0f} ms, "
            f"whole {best['whole'] * 1000:.0f} ms, speed-up {best['whole'] / best['chunked']:.2f}"
        )
    compare_prepacked(args.repeats)
    compare_layer_sizes(args.repeats)
    sentence_products(args.repeats)
    compare_unmasked()


def forward_each(embedder: Embedder, batches: list[list[Encoded]]) -> None:
    for batch in batches:
        embedder.forward(batch)


def compare_prepacked(repeats: int) -> None:
    print("the encoder's linear layers on each kernel, short sentences (~16 tokens)")
    for dtype, kernels in KERNELS.items():
        name = str(dtype).removeprefix("torch.")
        if not can_prepack(torch.device("cpu"), dtype):
            print(f"  {name}: not prepacked on this CPU (model.prepacked.can_prepack)")
            continue
        loaded = {kernel: on_kernel(kernel, name) for kernel in (*kernels, "F.linear")}
        for count in (1, 8, 32):
            # Many batches per timing: one sentence takes a few milliseconds.
            tokenize = loaded["F.linear"].tokenize
            batches = [tokenize(short_sentences(count, seed=seed)) for seed in range(64)]
            best = best_interleaved(
                {
                    kernel: functools.partial(forward_each, embedder, batches)
                    for kernel, embedder in loaded.items()
                },
                repeats,
            )
            print(f"  {name:8} batch {count:2}: " + speed_ups(best, len(batches), 1000, "ms"))


def on_kernel(kernel: str, dtype: str) -> Embedder:
    """The default model with its linear layers on `kernel`: mkl, onednn or F.linear."""
    with mock.patch.object(prepacked, "mkl_packs_float32", lambda: kernel == "mkl"):
        return Embedder.load(
            DEFAULT_MODEL_ID, device="cpu", dtype=dtype, prepack=kernel != "F.linear"
        )


def speed_ups(best: dict[str, float], calls: int, scale: float, unit: str) -> str:
    """Each kernel's time per call and its speed-up over F.linear."""
    return ", ".join(
        f"{kernel} {seconds / calls * scale:7.1f} {unit} ({best['F.linear'] / seconds:.2f}x)"
        for kernel, seconds in best.items()
    )


def compare_layer_sizes(repeats: int) -> None:
    """Each size on the same 200 inputs of random row counts. A oneDNN call pays a
    descriptor, a kernel for each new bucket of rows and the copy that pads its input to it;
    an MKL call copies the bias into its output; F.linear fits the weight to MKL's kernel."""
    if not can_prepack(torch.device("cpu"), torch.float32):
        print("float32 layers by size: not prepacked on this CPU (model.prepacked.can_prepack)")
        return
    print("one float32 layer on each kernel, by weights (in x out) and rows, per call")
    rng = random.Random(0)
    for inputs, outputs in LAYER_SIZES:
        plain = nn.Linear(inputs, outputs).eval()
        layers = {"mkl": MklLinear(plain), "onednn": OnednnLinear(plain), "F.linear": plain}
        for low, high in ROW_RANGES:
            xs = [torch.randn(rng.randint(low, high), inputs) for _ in range(200)]
            best = best_interleaved(
                {
                    kernel: functools.partial(each_row_count, layer, xs)
                    for kernel, layer in layers.items()
                },
                repeats,
            )
            print(
                f"  {inputs:4} x {outputs:4} ({inputs * outputs:7} weights), rows {low}-{high}: "
                + speed_ups(best, len(xs), 1e6, "us")
            )


def each_row_count(layer: nn.Module, xs: list[torch.Tensor]) -> None:
    with torch.inference_mode():
        for x in xs:
            layer(x)


def sentence_products(repeats: int, rows: int = 16) -> None:
    """In the model's order each layer's weights come from memory; alone and repeated, from
    the caches. Reading the weights once bounds the first from below, the second shows the
    arithmetic."""
    plain = on_kernel("F.linear", "float32")
    linears = [m for m in plain.network.modules() if type(m) is nn.Linear]
    weights = [layer.weight.detach() for layer in linears]
    size = sum(w.numel() for w in weights)
    flops = 2 * rows * size
    kernels: dict[str, list[nn.Linear | MklLinear]] = {"F.linear": list(linears)}
    if prepacked.mkl_packs_float32():
        kernels["mkl"] = [MklLinear(layer) for layer in linears]
    # One contiguous input per width, as the model's layers get theirs.
    inputs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in linears}
    print(
        f"one sentence's {len(linears)} float32 products, {rows} rows, "
        f"{size * 4 / 1e6:.1f} MB of weights"
    )
    read = best_interleaved({"read": lambda: [w.sum() for w in weights]}, repeats * 4)["read"]
    print(f"  reading the weights once: {read * 1e3:.2f} ms ({size * 4 / read / 1e9:.1f} GB/s)")
    for kernel, layers in kernels.items():
        in_order = best_interleaved(
            {kernel: functools.partial(in_model_order, layers, inputs)}, repeats * 4
        )[kernel]
        hot = sum(each_hot(layer, inputs[layer.in_features]) for layer in layers)
        print(
            f"  {kernel:8}: in the model's order {in_order * 1e3:.2f} ms, each layer hot "
            f"{hot * 1e3:.2f} ms ({flops / hot / 1e9:.0f} GFLOP/s)"
        )


def in_model_order(layers: list[nn.Linear | MklLinear], inputs: dict[int, torch.Tensor]) -> None:
    with torch.inference_mode():
        for layer in layers:
            layer(inputs[layer.in_features])


def each_hot(layer: nn.Module, x: torch.Tensor, calls: int = 50) -> float:
    """Seconds per call, the weights in the caches after the first calls."""
    with torch.inference_mode():
        for _ in range(5):
            layer(x)
        started = time.perf_counter()
        for _ in range(calls):
            layer(x)
    return (time.perf_counter() - started) / calls


def compare_unmasked(sentences: int = 100, calls: int = 400) -> None:
    """Each sentence run both ways in turn (the order alternating), medians: the difference is
    a few percent, less than this machine drifts between separate runs."""
    print("one sentence: attention with no mask against its all-ones mask added, per pass")
    cpu = torch.device("cpu")
    dtypes = ["float32"]
    if resolve_dtype("auto", cpu).dtype == torch.bfloat16:  # where the CPU computes it
        dtypes.append("bfloat16")
    if int8_unavailable(cpu) is None:
        dtypes.append("int8")
    for dtype in dtypes:
        embedder = Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype=dtype)
        batches = [embedder.tokenize([text]) for text in short_sentences(sentences, seed=4)]
        seconds: dict[str, list[float]] = {"no mask": [], "mask": []}
        for index in range(len(batches) + calls):  # the first round over them warms up
            batch = batches[index % len(batches)]
            for way in ("no mask", "mask") if index % 2 else ("mask", "no mask"):
                with masked() if way == "mask" else nullcontext():
                    started = time.perf_counter()
                    embedder.forward(batch)
                    if index >= len(batches):
                        seconds[way].append(time.perf_counter() - started)
        unmasked, mask = (statistics.median(seconds[way]) for way in ("no mask", "mask"))
        print(
            f"  {dtype:8}: no mask {unmasked * 1e3:.3f} ms, mask {mask * 1e3:.3f} ms "
            f"({unmasked / mask:.3f}x)"
        )


@contextmanager
def masked() -> Iterator[None]:
    """Passes whose mask hides nothing still made and added, as for a padded batch."""
    from_mask = TokenLayout.from_mask

    def with_mask(attention_mask: torch.Tensor) -> TokenLayout:
        layout = from_mask(attention_mask)
        return dataclasses.replace(layout, key_mask=Mask(layout.key_mask.allowed))

    with mock.patch.object(TokenLayout, "from_mask", with_mask):
        yield


if __name__ == "__main__":
    main()
