"""A front end's tokenizing of one short sentence, with the plain ASCII twin and without.

The default model's tokenizer (its 256 tokens and 30,522 ids; no do_lower_case, as its folder
says) as a front end builds it (`TokenizerSpec.build`), with plain ASCII twins
(model/plain_ascii.py), and as an engine's is, without them, each tokenizing the same
sentences one request at a time, in alternating blocks in one process: the machine's drift
hits both alike.
Prints each one's median and quartile µs per sentence and the ratio of the medians.
Usage: python -m bench.tokenizing [--blocks 400] [--sentences 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.workload import short_sentences
from model import DEFAULT_MODEL_ID
from model.resolve import resolve_model_dir
from model.tokenizer import TextTokenizer, TokenizerSpec


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
    folder = resolve_model_dir(DEFAULT_MODEL_ID)
    spec = TokenizerSpec((folder / "tokenizer.json").read_text(encoding="utf-8"), 256, 30522)
    tokenizers = {
        "with the twin": spec.build(),
        "without": TextTokenizer(spec.tokenizer_json, spec.max_length, spec.vocab_size),
    }
    texts = short_sentences(args.sentences, seed=9)
    times: dict[str, list[float]] = {name: [] for name in tokenizers}
    for index in range(args.blocks):
        order = list(tokenizers) if index % 2 else list(tokenizers)[::-1]
        for name in order:
            times[name].append(block(tokenizers[name], texts))
    for name, figures in times.items():
        low, median, high = statistics.quantiles(figures, n=4)
        print(f"{name:14} median {median:5.1f} µs per sentence (quartiles {low:.1f}, {high:.1f})")
    ratio = statistics.median(times["with the twin"]) / statistics.median(times["without"])
    print(f"with the twin / without: {ratio:.2f}x")


if __name__ == "__main__":
    main()
