"""Half precision on CUDA against float32 (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from model import Embedder
from model.cuda_graphs import all_buckets
from model.embedder import OnItsWay
from tests.model.test_parity_sentence_transformers import varied_sentences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_cuda_matches_float32(dtype: str) -> None:
    sentences = varied_sentences()
    reference = Embedder.load(device="cuda", dtype="float32").embed(sentences)
    half = Embedder.load(device="cuda", dtype=dtype)
    assert half.info.device.startswith("cuda")
    cosine = torch.nn.functional.cosine_similarity(reference, half.embed(sentences))
    print(f"{dtype}: min cosine {cosine.min().item():.6f}, mean {cosine.mean().item():.6f}")
    assert cosine.min() >= 0.999


def test_cuda_graphs_match_eager_forward_passes() -> None:
    """Replayed graphs against eager forward passes of the same batches, float32 on CUDA: max
    abs difference <= 1e-4 at every batch size (padded to 1, 4, 32 and 64 rows); a graph
    replayed for another batch in between gives the same vectors again."""
    graphed = Embedder.load(device="cuda", dtype="float32")
    eager = Embedder.load(device="cuda", dtype="float32", cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    captured = graphed.capture_graphs()
    print(f"{captured} graphs captured")
    assert captured == len(all_buckets(graphed.info.max_input_tokens))
    by_length = sorted(graphed.tokenize(varied_sentences()), key=lambda e: len(e.ids))
    for batch in (by_length[-1:], by_length[-3:], by_length[:17], by_length[:64]):
        width = max(len(e.ids) for e in batch)
        assert graphed.graphs.bucket(len(batch), width) is not None
        difference = (graphed.forward(batch).pooled - eager.forward(batch).pooled).abs().max()
        print(f"{len(batch)} inputs of up to {width} tokens: max abs difference {difference:.2e}")
        assert difference <= 1e-4
    first = graphed.forward(by_length[:3]).pooled
    graphed.forward(by_length[3:6])
    assert torch.equal(graphed.forward(by_length[:3]).pooled, first)


def test_graphed_passes_launched_back_to_back_each_keep_their_own_vectors() -> None:
    """Graphed passes queued on the GPU before any one's output is read (the batch worker
    overlaps two): one bucket for all, then two buckets; the third pass takes the first's
    pinned inputs slot again, and records its event again before the first is read. Each
    output equals its batch's eager pass (max abs difference <= 1e-4, float32)."""
    graphed = Embedder.load(device="cuda", dtype="float32")
    eager = Embedder.load(device="cuda", dtype="float32", cuda_graphs=False)
    graphed.capture_graphs()
    by_length = sorted(graphed.tokenize(varied_sentences()), key=lambda e: len(e.ids))
    for batches in (
        (by_length[:3], by_length[3:6], by_length[6:9]),
        (by_length[:3], by_length[-8:], by_length[9:12]),
    ):
        launched = [graphed.launch(batch) for batch in batches]
        assert all(isinstance(output, OnItsWay) for output in launched)
        for batch, output in zip(batches, launched, strict=True):
            expected = eager.forward(batch).pooled
            assert (output.result().pooled - expected).abs().max() <= 1e-4
