"""The padding mask as attention adds it to the scores (model/attention.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.profiler import profile

from model import Embedder
from model.attention import SCORES_AT_ONCE_KEYS, Mask, attend, key_padding_mask, sliding_window


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two threads, where short inputs take the scores at once; as it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def ops_of(call: object) -> dict[str, int]:
    """The aten ops a call ran, and how many times each."""
    assert callable(call)
    with profile() as profiled:
        call()
    return {event.key: event.count for event in profiled.key_averages()}


def qkv(
    batch: int, heads: int, width: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    numbers = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, width, 16, generator=numbers, dtype=dtype) for _ in range(3)]


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
    ways = ("aten::scaled_dot_product_attention", "aten::baddbmm")  # the two ways to a context
    assert sum(calls.get(way, 0) for way in ways) == tiny_embedder.info.num_layers


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("width", [1, 7, SCORES_AT_ONCE_KEYS])
def test_short_inputs_on_a_cpu_take_every_score_at_once_and_agree_with_sdpa(width: int) -> None:
    """Padding, a sliding window, a position bias and a scale: the context and the maps the
    same as the flash kernel's to float32's rounding."""
    q, k, v = qkv(3, 4, width)
    lengths = torch.tensor([width, max(1, width // 2), 1])
    padding = Mask(key_padding_mask((torch.arange(width) < lengths[:, None]).long()))
    window = padding & sliding_window(width, 100, q.device)  # wide enough to leave keys
    bias = torch.randn(1, 4, width, width)
    cases: list[tuple[Mask, torch.Tensor | None, float | None]] = [
        (padding, None, None),
        (window, None, None),
        (padding, bias, 0.3),
    ]
    for mask, position_bias, scale in cases:
        with profile() as profiled:
            context, maps = attend(q, k, v, mask, bias=position_bias, scale=scale, map_heads=(1, 2))
        calls = {event.key: event.count for event in profiled.key_averages()}
        assert calls.get("aten::baddbmm") == 1 and "aten::scaled_dot_product_attention" not in calls
        added = mask.added(q.dtype)
        if position_bias is not None:
            added = position_bias.masked_fill(~mask.allowed, float("-inf"))
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=added, scale=scale
        )
        assert (context - expected).abs().max() < 1e-5
        assert maps is not None and maps.shape == (3, 2, width, width)


@pytest.mark.usefixtures("two_threads")
def test_the_flash_kernel_keeps_what_every_score_at_once_does_not_win_or_cannot_do() -> None:
    """Long inputs, bfloat16, and a query with no key to attend to (all zeros from the flash
    kernel, where a softmax of the scores alone gives NaN)."""
    long_q, long_k, long_v = qkv(2, 2, SCORES_AT_ONCE_KEYS + 1)
    every = Mask(torch.ones(2, 1, 1, SCORES_AT_ONCE_KEYS + 1, dtype=torch.bool))
    half_q, half_k, half_v = qkv(2, 2, 8, torch.bfloat16)
    half_every = Mask(torch.ones(2, 1, 1, 8, dtype=torch.bool))
    q, k, v = qkv(2, 4, 8)
    empty = Mask(key_padding_mask(torch.tensor([[1] * 8, [0] * 8])))
    assert not empty.every_query_sees_a_key
    for call in (
        lambda: attend(long_q, long_k, long_v, every),
        lambda: attend(half_q, half_k, half_v, half_every),
        lambda: attend(q, k, v, empty),
    ):
        calls = ops_of(call)
        assert "aten::baddbmm" not in calls and calls["aten::scaled_dot_product_attention"] == 1
    context, _ = attend(q, k, v, empty)
    assert context[1].eq(0).all() and context[0].isfinite().all()


def test_one_thread_keeps_the_flash_kernel() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q, k, v = qkv(4, 4, 8)
        calls = ops_of(lambda: attend(q, k, v, Mask(torch.ones(4, 1, 1, 8, dtype=torch.bool))))
    finally:
        torch.set_num_threads(before)
    assert "aten::baddbmm" not in calls and calls["aten::scaled_dot_product_attention"] == 1
