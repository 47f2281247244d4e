"""Half precision on CUDA against float32 (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from model import Embedder
from tests.model.test_parity_sentence_transformers import varied_sentences

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_cuda_matches_float32(dtype: str) -> None:
    sentences = varied_sentences()
    reference = Embedder.load(device="cuda", dtype="float32").embed(sentences)
    half = Embedder.load(device="cuda", dtype=dtype)
    assert half.info.device.startswith("cuda")
    cosine = torch.nn.functional.cosine_similarity(reference, half.embed(sentences))
    print(f"{dtype}: min cosine {cosine.min().item():.6f}, mean {cosine.mean().item():.6f}")
    assert cosine.min() >= 0.999
