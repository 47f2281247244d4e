"""The padding mask as attention adds it to the scores (model/attention.py)."""

from __future__ import annotations

import torch
from torch.profiler import profile

from model import Embedder
from model.attention import Mask, key_padding_mask


def test_a_mask_adds_zero_where_a_key_is_allowed_and_minus_infinity_elsewhere() -> None:
    mask = Mask(key_padding_mask(torch.tensor([[1, 1, 0], [1, 0, 0]])))
    added = mask.added(torch.bfloat16)
    assert added.dtype == torch.bfloat16 and added.shape == (2, 1, 1, 3)
    assert added[mask.allowed].eq(0).all() and added[~mask.allowed].eq(float("-inf")).all()
    assert mask.added(torch.bfloat16) is added  # made once per dtype
    narrower = mask & torch.tensor([True, False, True])
    assert narrower.added(torch.float32)[0, 0, 0].tolist() == [0.0, float("-inf"), float("-inf")]


def test_a_pass_converts_its_padding_mask_once_not_in_every_layer(
    tiny_embedder: Embedder,
) -> None:
    """Handed the boolean mask, attention would convert it in each layer (two `where` calls
    each)."""
    batch = tiny_embedder.tokenize(["hello world fox", "hello"])
    assert tiny_embedder.info.num_layers > 1
    with profile() as profiled:
        tiny_embedder.forward(batch)
    calls = {event.key: event.count for event in profiled.key_averages()}
    assert calls.get("aten::where", 0) == 0
    assert calls["aten::scaled_dot_product_attention"] == tiny_embedder.info.num_layers
