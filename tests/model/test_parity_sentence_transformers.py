"""Parity with `sentence-transformers` on the real all-MiniLM-L6-v2 from the installed package."""

from __future__ import annotations

import itertools
import random

import torch
from sentence_transformers import SentenceTransformer

from model import Embedder
from model.resolve import resolve_model_dir

MIN_COSINE = 0.99999
SHORT = [
    "hello world",
    "A man is eating food.",
    "The cat sits on the mat",
    "ok",
    "?",
    "",
    "   ",
    "Paris is the capital of France.",
    "GPU inference at scale",
    "1234 5678",
]
NON_ASCII = [
    "Größe und Übermaß",
    "café crème brûlée",
    "東京は日本の首都です",
    "🚀 launch day 🎉",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "naïve façade jalapeño",
    "Ελληνικά γράμματα",
    "한국어 문장입니다",
    "emoji only: 😀😃😄",
]
WORDS = [
    "embedding",
    "service",
    "transformer",
    "attention",
    "padding",
    "batch",
    "token",
    "vector",
    "model",
    "latency",
    "throughput",
    "request",
    "queue",
    "worker",
    "metrics",
    "health",
    "probe",
    "kubernetes",
    "replica",
    "gpu",
    "cpu",
]


def varied_sentences() -> list[str]:
    rng = random.Random(7)
    sentences = SHORT + NON_ASCII
    for n in (3, 8, 20, 60, 150, 300, 600):  # the longer ones go past max_seq_length (256)
        for _ in range(20):
            sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)))
    for a, b in itertools.product(SHORT, NON_ASCII[:6]):
        sentences.append(f"{a} — {b}")
    sentences += ["def f(x):\n    return x * 2", "SELECT * FROM t WHERE id = 1;", "a" * 2000]
    return sentences


def test_all_minilm_matches_sentence_transformers(minilm: Embedder) -> None:
    sentences = varied_sentences()
    assert len(sentences) >= 200
    reference = SentenceTransformer(
        str(resolve_model_dir("sentence-transformers/all-MiniLM-L6-v2")), device="cpu"
    )
    expected = reference.encode(sentences, batch_size=32, convert_to_tensor=True)
    got = minilm.embed(sentences)
    cosine = torch.nn.functional.cosine_similarity(got, expected)
    worst = int(cosine.argmin())
    assert cosine.min() >= MIN_COSINE, f"{sentences[worst][:60]!r}: cosine {cosine[worst]}"
    assert (got - expected).abs().max() <= 1e-5
    truncated = [e.truncated for e in minilm.tokenize(sentences)]
    assert any(truncated) and not all(truncated)
