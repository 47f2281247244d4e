"""An input alone equals the same input inside a padded batch of mixed lengths."""

from __future__ import annotations

import pytest
import torch

from model import AttentionSpec, Embedder, packing
from tests.helpers import every_map, map_request

TOLERANCE = 1e-5
TEXTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog, the quick brown fox jumps again",
    "",
    "hello world é",
    "a b c d e f g h i j k l m n o p",
]


def check_invariance(embedder: Embedder, texts: list[str]) -> None:
    encoded = embedder.tokenize(texts)
    ids = [e.ids for e in encoded]
    maps = every_map(embedder)
    batch = embedder.forward(ids, token_embeddings=True, attention=maps)
    assert batch.token_embeddings is not None and batch.attentions is not None
    for row, sequence in enumerate(ids):
        alone = embedder.forward([sequence], token_embeddings=True, attention=maps)
        assert alone.token_embeddings is not None and alone.attentions is not None
        assert (alone.pooled[0] - batch.pooled[row]).abs().max() <= TOLERANCE
        assert batch.token_embeddings[row].shape == (len(sequence), embedder.info.dimensions)
        assert (alone.token_embeddings[0] - batch.token_embeddings[row]).abs().max() <= TOLERANCE
        for layer in maps.layers:
            difference = alone.attentions[0][layer] - batch.attentions[row][layer]
            assert difference.abs().max() <= TOLERANCE
    # Without maps, and with the mean of some heads: the same vectors.
    plain = embedder.forward(ids)
    assert (plain.pooled - batch.pooled).abs().max() <= TOLERANCE
    mean = embedder.forward(ids, attention=AttentionSpec((0,), (0, 1), mean=True))
    assert mean.attentions is not None
    for row, n in enumerate(len(sequence) for sequence in ids):
        assert mean.attentions[row][0].shape == (n, n)
        want = batch.attentions[row][0][:2].mean(dim=0)
        assert (mean.attentions[row][0] - want).abs().max() <= TOLERANCE


def test_tiny_model_batch_invariance(tiny_embedder: Embedder) -> None:
    check_invariance(tiny_embedder, TEXTS)


def test_real_model_batch_invariance(minilm: Embedder) -> None:
    check_invariance(minilm, [*TEXTS, "Größe 東京 🚀 " * 30])


def test_fully_padded_row_gives_no_nan(tiny_embedder: Embedder) -> None:
    out = tiny_embedder.forward(
        [[], [2, 40, 3]], token_embeddings=True, attention=every_map(tiny_embedder)
    )
    assert out.token_embeddings is not None and out.attentions is not None
    assert torch.isfinite(out.pooled).all()
    assert out.pooled[0].abs().max() == 0
    assert out.token_embeddings[0].shape == (0, tiny_embedder.info.dimensions)
    for maps in out.attentions:
        for probs in maps.values():
            assert torch.isfinite(probs).all()
    # Padded keys get exactly zero probability and each real row still sums to one.
    ids = torch.tensor([[2, 40, 3], [2, 3, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.inference_mode():
        maps = tiny_embedder.network(ids, mask, None, map_request({1}, 4)).maps
    assert (maps[1][1, :, :, 2] == 0).all()
    assert torch.allclose(maps[1][1, :, :2].sum(-1), torch.ones(4, 2), atol=1e-6)


def test_packed_and_grid_layouts_agree(minilm: Embedder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Position-wise layers on packed real tokens give what the padded grid gives."""
    ids = [e.ids for e in minilm.tokenize(TEXTS)]
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", 0.0)
    packed = minilm.forward(ids, token_embeddings=True, attention=every_map(minilm, [0]))
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", 1.1)
    grid = minilm.forward(ids, token_embeddings=True, attention=every_map(minilm, [0]))
    assert packed.token_embeddings is not None and grid.token_embeddings is not None
    assert (packed.pooled - grid.pooled).abs().max() <= TOLERANCE
    for a, b in zip(packed.token_embeddings, grid.token_embeddings, strict=True):
        assert (a - b).abs().max() <= TOLERANCE
    assert packed.attentions is not None and grid.attentions is not None
    for a_maps, b_maps in zip(packed.attentions, grid.attentions, strict=True):
        assert (a_maps[0] - b_maps[0]).abs().max() <= TOLERANCE


def test_chunked_feed_forward_matches_whole(
    tiny_embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [e.ids for e in tiny_embedder.tokenize(TEXTS)]
    whole = tiny_embedder.forward(ids, token_embeddings=True)
    monkeypatch.setattr(packing, "FEED_FORWARD_CHUNK", 3)  # far fewer than the batch's tokens
    chunked = tiny_embedder.forward(ids, token_embeddings=True)
    assert whole.token_embeddings is not None and chunked.token_embeddings is not None
    for a, b in zip(whole.token_embeddings, chunked.token_embeddings, strict=True):
        assert (a - b).abs().max() <= TOLERANCE


def test_packing_is_decided_on_the_cpu_only() -> None:
    """Off the CPU the layers run on the grid, without reading the mask back (a device sync):
    a mask on the meta device has no values to read, so packing would fail on it."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    assert packing.TokenLayout.from_mask(mask).index is not None  # 62% padding, on the CPU
    on_device = packing.TokenLayout.from_mask(mask.to("meta"))
    assert on_device.index is None
    assert on_device.key_mask.allowed.shape == (2, 1, 1, 4)
