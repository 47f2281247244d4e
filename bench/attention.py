"""Attention on a CPU: torch's flash kernel against every score at once (model/attention.py).

1. The kernels alone, on (B, 12, T, 32) queries, keys and values as the default model's
   layers make them (views of one (B, T, 3 x 12 x 32) projection), with a padding mask (the
   scores at once over keys padded to model.attention.KEY_LANES, as the model runs them), the
   heads merged back into (B, T, 12 x 32) after: on each thread count, the time of every
   score at once over the flash kernel's, for batches of B inputs T tokens long (below 1:
   the scores at once are faster). What sets SCORES_AT_ONCE_KEYS.
2. The default model, on one thread and on `--threads`, in each dtype: batches of 32 short
   sentences, one sentence, and 8 long passages (past the limits: both take the flash
   kernel, a check on the drift), with the limits as they are and at 0 (the flash kernel
   always), alternating in one process; each one's median ms per call and the ratio of the
   medians.
Usage: python -m bench.attention [--threads 2] [--dtypes float32 int8] [--rounds 6]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.products import median_ms
from bench.side_by_side import turns
from bench.workload import long_passages, short_sentences
from model import DEFAULT_MODEL_ID, Embedder, attention
from model.attention import Mask, context_of_all_scores, key_padding_mask, padded_keys

BATCHES = (1, 4, 16, 32, 64)
# Widths off multiples of 16 too: those pad their keys (model.attention.KEY_LANES).
WIDTHS = (8, 13, 16, 24, 31, 48, 64, 96)
HEADS, DEPTH = 12, 32


def kernel_ratio(batch: int, width: int) -> float:
    """Every score at once over the flash kernel, on one padded batch."""
    numbers = torch.Generator().manual_seed(batch * 1000 + width)
    projected = torch.randn(batch, width, 3 * HEADS, DEPTH, generator=numbers)
    q, k, v = projected.transpose(1, 2).chunk(3, dim=1)
    lengths = torch.randint(max(1, width // 2), width + 1, (batch,), generator=numbers)
    lengths[0] = width
    mask = Mask(key_padding_mask((torch.arange(width) < lengths[:, None]).long()))
    added, padded = mask.added(q.dtype), mask.added(q.dtype, padded_keys(width))
    calls = max(3, 3000 // (batch * (width * width // 64 + 4)))
    scale = 1 / math.sqrt(DEPTH)

    def flash() -> Tensor:
        return merged(F.scaled_dot_product_attention(q, k, v, attn_mask=added, scale=scale))

    def at_once() -> Tensor:
        return merged(context_of_all_scores(q, k, v, padded, scale))

    with torch.inference_mode():
        return median_ms(at_once, calls) / median_ms(flash, calls)


def merged(context: Tensor) -> Tensor:
    """(B, H, T, hd) -> (B, T, H x hd), as the layers go on with the context (the flash
    kernel's output is laid out so already; the scores at once' is copied)."""
    return context.transpose(1, 2).reshape(context.shape[0], context.shape[2], -1)


def kernels(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"\nevery score at once / the flash kernel, {threads} thread(s); rows B, columns T")
    print("      " + "".join(f"{width:>7d}" for width in WIDTHS))
    for batch in BATCHES:
        ratios = "".join(f"{kernel_ratio(batch, width):7.2f}" for width in WIDTHS)
        print(f"B {batch:3d}{ratios}", flush=True)


def encoder(dtype: str, threads: int, rounds: int) -> None:
    torch.set_num_threads(threads)
    embedder = Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype=dtype)
    loads = {
        "32 short": (short_sentences(32, seed=1), 5),
        "1 short": (short_sentences(1, seed=2), 30),
        "8 long": (long_passages(8, seed=3), 2),
    }
    ways = {
        "as it is": (attention.SCORES_AT_ONCE_KEYS, attention.SCORES_AT_ONCE_KEYS_ONE_THREAD),
        "flash always": (0, 0),
    }
    print(f"\nthe default model, {dtype}, {threads} thread(s): median ms per call")
    for load, (texts, calls) in loads.items():
        times: dict[str, list[float]] = {name: [] for name in ways}
        call = functools.partial(embedder.embed, texts)
        for index in range(rounds):
            for name in turns(list(ways), index):
                with limits(*ways[name]):
                    times[name].append(median_ms(call, calls))
        medians = {name: statistics.median(values) for name, values in times.items()}
        figures = ", ".join(f"{name} {ms:.2f}" for name, ms in medians.items())
        ratio = medians["as it is"] / medians["flash always"]
        print(f"{load:>9}: {figures}; as it is / flash always {ratio:.2f}x", flush=True)


@contextmanager
def limits(keys: int, one_thread: int) -> Iterator[None]:
    """model.attention's limits for every score at once, on two threads and on one."""
    with (
        mock.patch.object(attention, "SCORES_AT_ONCE_KEYS", keys),
        mock.patch.object(attention, "SCORES_AT_ONCE_KEYS_ONE_THREAD", one_thread),
    ):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "int8"])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    thread_counts = sorted({1, args.threads})
    for threads in thread_counts:
        kernels(threads)
    for dtype in args.dtypes:
        for threads in thread_counts:
            encoder(dtype, threads, args.rounds)


if __name__ == "__main__":
    main()
