"""bfloat16 on the CPU, which dtype=auto picks where the CPU computes it natively, stays
within cosine 0.999 of float32 on the parity sentences."""

from __future__ import annotations

import torch

from model import Embedder
from tests.model.test_parity_sentence_transformers import varied_sentences


def test_bfloat16_keeps_every_cosine_above_0_999(minilm: Embedder) -> None:
    sentences = varied_sentences()
    half = Embedder.load(device="cpu", dtype="bfloat16")
    assert half.info.dtype == "bfloat16"
    cosine = torch.nn.functional.cosine_similarity(minilm.embed(sentences), half.embed(sentences))
    assert len(sentences) > 200
    assert cosine.min() >= 0.999, f"min cosine {cosine.min().item():.6f}"
