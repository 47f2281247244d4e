"""A front end's tokenizing of one short sentence, with the plain ASCII twin and without.

The default model's tokenizer as a front end builds it from the model's card
(`TokenizerSpec.build`, with plain ASCII twins: model/plain_ascii.py) and as the engine's
`Embedder` holds it (without them), each tokenizing the same sentences one request at a time,
in alternating blocks in one process: the machine's drift hits both alike.
Prints each one's median and quartile µs per sentence and the ratio of the medians.
Usage: python -m bench.tokenizing [--blocks 400] [--sentences 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.side_by_side import turns
from bench.workload import short_sentences
from model import Embedder
from model.tokenizer import TextTokenizer


def block(tokenizer: TextTokenizer, texts: list[str]) -> float:
    """µs per text, each tokenized as a request of its own."""
    started = time.perf_counter()
    for text in texts:
        tokenizer.encode([text])
    return (time.perf_counter() - started) / len(texts) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=400)
    parser.add_argument("--sentences", type=int, default=64)
    args = parser.parse_args()
    engine_tokenizer = Embedder.load(device="cpu", dtype="float32").tokenizer
    tokenizers = {"with the twin": engine_tokenizer.spec.build(), "without": engine_tokenizer}
    texts = short_sentences(args.sentences, seed=9)
    times: dict[str, list[float]] = {name: [] for name in tokenizers}
    for index in range(args.blocks):
        for name in turns(list(tokenizers), index):
            times[name].append(block(tokenizers[name], texts))
    medians = {name: statistics.median(figures) for name, figures in times.items()}
    for name, figures in times.items():
        low, _, high = statistics.quantiles(figures, n=4)
        print(
            f"{name:14} median {medians[name]:5.1f} µs per sentence "
            f"(quartiles {low:.1f}, {high:.1f})"
        )
    print(f"with the twin / without: {medians['with the twin'] / medians['without']:.2f}x")


if __name__ == "__main__":
    main()
