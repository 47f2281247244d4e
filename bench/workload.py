"""The texts the benchmarks send: short STS-style sentences (about 16 tokens with MiniLM's
vocabulary) and long passages (about 200 tokens)."""

from __future__ import annotations

import random

SUBJECTS = ["The service", "A worker", "Our model", "The queue", "Each request", "The cluster"]
VERBS = ["returns", "batches", "embeds", "drops", "measures", "answers"]
OBJECTS = [
    "short sentences quickly",
    "vectors for search",
    "inputs of mixed length",
    "requests from many clients",
    "tokens on two cores",
    "results in order",
]
WORDS = (
    "service latency vector model request batch token queue worker search index "
    "document answer question retrieval ranking query cluster memory network"
).split()


def short_sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
        f"number {rng.randint(0, 9999)}."
        for _ in range(count)
    ]


def long_passages(count: int, seed: int = 0, words: int = 190) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def varied_sentences(count: int, seed: int = 0) -> list[str]:
    """Sentences of 3 to 40 words, most near a dozen, as STS-B's are (with fewer words
    to choose from: no data set is downloaded)."""
    rng = random.Random(seed)
    vocabulary = WORDS + [word for phrase in SUBJECTS + OBJECTS for word in phrase.split()]
    lengths = [min(40, max(3, round(rng.lognormvariate(2.4, 0.5)))) for _ in range(count)]
    return [" ".join(rng.choice(vocabulary) for _ in range(n)).capitalize() + "." for n in lengths]
