"""What compact vectors cost a search: recall@10 of int8 and binary codes against float32.

The default model embeds a corpus and a set of queries (generated sentences of 3 to 40 words,
bench/workload.py: no data set is downloaded). Float32 cosine search gives each query's true
top 10; each compact search is scored by how many of those it finds in its own top 10:
- int8 and uint8: the codes the server gives (/embed's `encoding`, on the ranges of the
  server's built-in calibration texts), searched by the Euclidean distance between codes
  (which each dimension's offset does not change), and int8 by their dot product too;
- binary: the packed sign bits, searched by Hamming distance;
- rescored, int8 and binary: the 40 nearest by the codes (Euclidean or Hamming distance),
  re-ranked by the float32 query against the float32 documents (kept beside the index, as a
  vector database keeps them), the usual way to win back most of what the codes lose.
Written to bench/results/retrieval_quality.json.
Usage: python -m bench.retrieval_quality [--documents 5000] [--queries 300]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.workload import varied_sentences
from model import DEFAULT_MODEL_ID, Embedder
from model.quantization import Calibration, builtin_calibration_texts, quantize
from model.vectors import FloatArray, finish

RESULTS = Path(__file__).resolve().parent / "results" / "retrieval_quality.json"
TOP = 10
RESCORE_CANDIDATES = 40
BATCH = 64
Ranking = npt.NDArray[np.int64]


def embed(embedder: Embedder, texts: list[str]) -> FloatArray:
    """The pipeline's vectors (before the request's own finishing)."""
    return np.concatenate(
        [
            embedder.forward(embedder.tokenize(texts[start : start + BATCH])).pooled.numpy()
            for start in range(0, len(texts), BATCH)
        ]
    )


def top(scores: npt.NDArray[np.floating] | npt.NDArray[np.integer], count: int) -> Ranking:
    """Each row's `count` highest-scoring columns, best first."""
    best: Ranking = np.argsort(-scores, axis=1, kind="stable")[:, :count]
    return best


def recall(found: Ranking, truth: Ranking) -> float:
    hits = sum(len(set(row) & set(expected)) for row, expected in zip(found, truth, strict=True))
    return hits / truth.size


def squared_distances(queries: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """Each query's squared Euclidean distance to each document."""
    cross: np.ndarray = queries @ documents.T
    distances: np.ndarray = (
        (queries**2).sum(1)[:, None] + (documents**2).sum(1)[None, :] - 2 * cross
    )
    return distances


def hamming_scores(queries: np.ndarray, documents: np.ndarray) -> npt.NDArray[np.int64]:
    """Minus the number of differing bits between each query's and each document's codes."""
    query_bits = np.unpackbits(queries, axis=1).astype(np.int64)
    document_bits = np.unpackbits(documents, axis=1).astype(np.int64)
    agree = query_bits @ document_bits.T + (1 - query_bits) @ (1 - document_bits).T
    differ: npt.NDArray[np.int64] = agree - query_bits.shape[1]
    return differ


def rescore(scores: npt.NDArray[np.integer], queries: FloatArray, documents: FloatArray) -> Ranking:
    """The top RESCORE_CANDIDATES by the codes' scores, re-ranked by the float32 query
    against the float32 documents: the top TOP of those."""
    candidates = top(scores, RESCORE_CANDIDATES)
    exact = np.einsum("qd,qkd->qk", queries, documents[candidates])
    return np.take_along_axis(candidates, top(exact, TOP), axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=5000)
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args()
    embedder = Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype="float32")
    documents = finish(embed(embedder, varied_sentences(args.documents, seed=21)), True)
    queries = finish(embed(embedder, varied_sentences(args.queries, seed=22)), True)
    ranges = Calibration(embed(embedder, builtin_calibration_texts())).ranges(True, None)
    truth = top(queries @ documents.T, TOP)
    figures: dict[str, float] = {}
    # uint8 codes are int8's plus 128: the same distances, so one search serves both.
    query_codes = quantize(queries, "int8", ranges).astype(np.int64)
    document_codes = quantize(documents, "int8", ranges).astype(np.int64)
    euclidean = -squared_distances(query_codes, document_codes)
    figures["int8 or uint8, Euclidean distance"] = recall(top(euclidean, TOP), truth)
    figures["int8, dot product"] = recall(top(query_codes @ document_codes.T, TOP), truth)
    rescoring = f"top {RESCORE_CANDIDATES} rescored in float32"
    figures[f"int8, {rescoring}"] = recall(rescore(euclidean, queries, documents), truth)
    hamming = hamming_scores(
        quantize(queries, "ubinary", ranges), quantize(documents, "ubinary", ranges)
    )
    figures["binary"] = recall(top(hamming, TOP), truth)
    figures[f"binary, {rescoring}"] = recall(rescore(hamming, queries, documents), truth)
    print(
        f"all-MiniLM-L6-v2: {args.queries} queries against {args.documents} documents; "
        f"recall@{TOP} against float32 search"
    )
    for name, value in figures.items():
        print(f"  {name:<40} {value:.3f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"arguments": vars(args), "recall_at_10": figures}, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
