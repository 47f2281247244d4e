"""This encoder against sentence-transformers: same model, inputs and thread count.

Timings interleave the two engines call by call in one process, so that both see the same
machine noise; peak memory (max RSS) is read from one fresh process per engine.
Usage: python -m bench.encoder [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from collections.abc import Callable

import torch

BATCHES = (1, 32, 128)
LENGTHS = {"short": 12, "long": 190}  # words; about 16 and 200 tokens with MiniLM's vocabulary
ENGINES = ("ours", "sentence-transformers")
WORDS = (
    "service latency vector model request batch token queue worker search index "
    "document answer question retrieval ranking query cluster memory network"
).split()

Encode = Callable[[list[str]], object]


def make_texts(words: int, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def load_engine(engine: str) -> Encode:
    from model import DEFAULT_MODEL_ID, Embedder

    if engine == "ours":
        return Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype="float32").embed
    from sentence_transformers import SentenceTransformer

    from model.resolve import resolve_model_dir

    st = SentenceTransformer(str(resolve_model_dir(DEFAULT_MODEL_ID)), device="cpu")
    return lambda texts: st.encode(texts, batch_size=len(texts), convert_to_tensor=True)


def points() -> list[tuple[str, list[str]]]:
    return [
        (f"{name}/{batch}", make_texts(words, batch, seed=batch))
        for name, words in LENGTHS.items()
        for batch in BATCHES
    ]


def best_interleaved(
    engines: dict[str, Encode], texts: list[str], repeats: int
) -> dict[str, float]:
    best = dict.fromkeys(engines, float("inf"))
    for encode in engines.values():
        encode(texts)  # warm-up at this shape
    for _ in range(repeats):
        for name, encode in engines.items():
            start = time.perf_counter()
            encode(texts)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def peak_rss_mib(engine: str, threads: int) -> float:
    """Load one engine in a fresh process, run every point once, return its peak RSS.

    VmHWM belongs to the child's own address space; ru_maxrss would carry over the parent's
    high-water mark through fork and exec.
    """
    code = (
        "import re, torch; from bench.encoder import load_engine, points; "
        f"torch.set_num_threads({threads}); encode = load_engine({engine!r}); "
        "[encode(texts) for _, texts in points()]; "
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return int(output.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {name: load_engine(name) for name in ENGINES}
    from model import Embedder

    tokenizer = Embedder.load(device="cpu").tokenizer
    print(f"all-MiniLM-L6-v2 on CPU, {args.threads} threads, best of {args.repeats}, interleaved")
    print(f"{'input':<12}{'tokens':>8}{'ours tok/s':>12}{'s-t tok/s':>12}{'ratio':>8}")
    for key, texts in points():
        tokens = sum(len(e.ids) for e in tokenizer.encode(texts))
        best = best_interleaved(engines, texts, args.repeats)
        ours, theirs = tokens / best["ours"], tokens / best["sentence-transformers"]
        print(f"{key:<12}{tokens:>8}{ours:>12.0f}{theirs:>12.0f}{ours / theirs:>8.2f}")
    rss = {name: peak_rss_mib(name, args.threads) for name in ENGINES}
    ours_mib, theirs_mib = rss["ours"], rss["sentence-transformers"]
    print(
        f"peak RSS MiB: ours {ours_mib:.0f}, sentence-transformers {theirs_mib:.0f}, "
        f"ratio {ours_mib / theirs_mib:.2f}"
    )


if __name__ == "__main__":
    main()
