"""The padding mask as attention adds it to the scores (model/attention.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar
from unittest import mock

import pytest
import torch
from torch.profiler import profile

from bench.layers import masked
from model import Embedder, attention
from model.attention import (
    SCORES_AT_ONCE_KEYS,
    SCORES_AT_ONCE_KEYS_ONE_THREAD,
    Mask,
    attend,
    key_padding_mask,
    sliding_window,
)
from model.packing import TokenLayout

T = TypeVar("T")
# The two ways to a context.
FLASH, AT_ONCE = "aten::scaled_dot_product_attention", "aten::baddbmm"
# What making a padding mask and asking it for a row masked whole run (Mask.added and
# Mask.every_query_sees_a_key); attention maps mask their own scores (`masked_fill`).
MASK_MAKING = {"aten::masked_fill_", "aten::any"}


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch on `count` threads, as it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Where short inputs take every score at once."""
    with torch_threads(2):
        yield


def profiled(call: Callable[[], T]) -> tuple[T, dict[str, int]]:
    """What a call returned, and the aten ops it ran with how many times each."""
    with profile() as run:
        result = call()
    return result, {event.key: event.count for event in run.key_averages()}


@contextmanager
def flash_always() -> Iterator[None]:
    """The flash kernel on every thread count."""
    with (
        mock.patch.object(attention, "SCORES_AT_ONCE_KEYS", 0),
        mock.patch.object(attention, "SCORES_AT_ONCE_KEYS_ONE_THREAD", 0),
    ):
        yield


def qkv(
    batch: int, heads: int, width: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Random queries, keys and values, (batch, heads, width, 16) each."""
    numbers = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, width, 16, generator=numbers, dtype=dtype) for _ in range(3)]


def test_a_mask_adds_zero_where_a_key_is_allowed_and_minus_infinity_elsewhere() -> None:
    mask = Mask(key_padding_mask(torch.tensor([[1, 1, 0], [1, 0, 0]])))
    added = mask.added(torch.bfloat16)
    assert added is not None
    assert added.dtype == torch.bfloat16 and added.shape == (2, 1, 1, 3)
    assert added[mask.allowed].eq(0).all() and added[~mask.allowed].eq(float("-inf")).all()
    assert mask.added(torch.bfloat16) is added  # made once per dtype
    narrower = mask.narrowed(torch.tensor([True, False, True]))
    narrowed = narrower.added(torch.float32)
    assert narrowed is not None
    assert narrowed[0, 0, 0].tolist() == [0.0, float("-inf"), float("-inf")]


def test_a_mask_over_padded_keys_adds_minus_infinity_past_its_own() -> None:
    """The columns every score at once pads its keys with (model.attention.KEY_LANES): no
    query may attend to them, whether or not the mask hides anything of its own."""
    mask = Mask(key_padding_mask(torch.tensor([[1, 1, 0], [1, 0, 0]])))
    added, own = mask.added(torch.float32, 5), mask.added(torch.float32)
    assert added is not None and own is not None and added.shape == (2, 1, 1, 5)
    assert torch.equal(added[..., :3], own)
    assert added[..., 3:].eq(float("-inf")).all()
    assert mask.added(torch.float32, 5) is added  # made once per dtype and width
    whole = Mask(torch.ones(1, 1, 1, 3, dtype=torch.bool), hides_nothing=True)
    assert whole.added(torch.float32) is None and whole.added(torch.float32, 3) is None
    padded = whole.added(torch.float32, 5)
    assert padded is not None
    assert padded[0, 0, 0].tolist() == [0.0, 0.0, 0.0, float("-inf"), float("-inf")]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("width", "keys"), [(7, 7), (8, 16), (13, 16), (16, 16), (17, 17)])
def test_every_score_at_once_runs_its_softmax_over_a_whole_vector_of_keys(
    threads: int, width: int, keys: int
) -> None:
    """torch's softmax takes the rest past whole vectors one value at a time, much slower:
    from half a vector's keys to one, they are padded to a whole one (16), and the context is
    the flash kernel's."""
    q, k, v = qkv(2, 3, width)
    mask = Mask(key_padding_mask((torch.arange(width) < torch.tensor([[width], [3]])).long()))
    with torch_threads(threads), profile(record_shapes=True) as run:
        context, _ = attend(q, k, v, mask)
    softmax = [
        event
        for event in run.key_averages(group_by_input_shape=True)
        if event.key == "aten::softmax"
    ]
    assert [event.input_shapes[0] for event in softmax] == [[6, width, keys]]
    with torch_threads(threads), flash_always():
        expected, _ = attend(q, k, v, mask)
    assert (context - expected).abs().max() < 1e-5


def test_a_batch_without_padding_has_a_mask_that_hides_nothing() -> None:
    """Known from the mask the layout reads anyway (the packing decision): nothing to add,
    and no row masked whole, without asking the tensor. A narrower mask hides again."""
    full = TokenLayout.from_mask(torch.ones(2, 5, dtype=torch.long)).key_mask
    padded = TokenLayout.from_mask(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])).key_mask
    assert full.hides_nothing and full.added(torch.float32) is None
    assert full.every_query_sees_a_key
    assert not padded.hides_nothing and padded.added(torch.float32) is not None
    causal = full.narrowed(torch.ones(5, 5, dtype=torch.bool).tril())
    assert not causal.hides_nothing and causal.added(torch.float32) is not None


@pytest.mark.parametrize("way", [FLASH, AT_ONCE])
@pytest.mark.parametrize("width", [9, 16])  # keys padded for the softmax, and not
@pytest.mark.parametrize("biased", [False, True])
def test_a_mask_that_hides_nothing_gives_the_context_of_one_that_adds_zeros(
    way: str, width: int, biased: bool
) -> None:
    q, k, v = qkv(2, 3, width)
    allowed = torch.ones(2, 1, 1, width, dtype=torch.bool)
    bias = torch.randn(1, 3, width, width) if biased else None
    unmasked = Mask(allowed, hides_nothing=True)
    with flash_always() if way == FLASH else contextlib.nullcontext():
        (context, _), calls = profiled(lambda: attend(q, k, v, unmasked, bias=bias))
        expected, _ = attend(q, k, v, Mask(allowed), bias=bias)
        _, maps = attend(q, k, v, unmasked, bias=bias, map_heads=(0, 2))
        _, expected_maps = attend(q, k, v, Mask(allowed), bias=bias, map_heads=(0, 2))
    assert not MASK_MAKING.intersection(calls)
    assert calls.get(way) == 1
    assert torch.equal(context, expected)
    assert maps is not None and expected_maps is not None and torch.equal(maps, expected_maps)


def test_a_model_pass_without_padding_makes_no_mask_and_gives_the_same_vectors(
    tiny_embedder: Embedder,
) -> None:
    """One sentence, or sentences of one length: the padding mask is never made; the
    vectors are those of the masked pass."""
    batch = tiny_embedder.tokenize(["hello world fox", "fox hello world"])
    assert len({len(e.ids) for e in batch}) == 1
    unmasked, calls = profiled(lambda: tiny_embedder.forward(batch))
    assert not MASK_MAKING.intersection(calls)
    with masked():
        with_mask, calls = profiled(lambda: tiny_embedder.forward(batch))
    assert calls.get("aten::masked_fill_") == 1
    assert torch.equal(unmasked.pooled, with_mask.pooled)


def test_a_pass_converts_its_padding_mask_once_not_in_every_layer(
    tiny_embedder: Embedder,
) -> None:
    """Handed the boolean mask, attention would convert it in each layer (two `where` calls
    each)."""
    batch = tiny_embedder.tokenize(["hello world fox", "hello"])
    assert tiny_embedder.info.num_layers > 1
    _, calls = profiled(lambda: tiny_embedder.forward(batch))
    assert calls.get("aten::where", 0) == 0
    assert calls.get(FLASH, 0) + calls.get(AT_ONCE, 0) == tiny_embedder.info.num_layers


@pytest.mark.usefixtures("two_threads")
def test_a_model_on_two_threads_gives_the_same_vectors_either_way(
    tiny_embedder: Embedder,
) -> None:
    """Through the layers as they make queries, keys and values (views of the packed tokens)
    and merge the heads back."""
    batch = tiny_embedder.tokenize(["hello world fox jumps over", "hello", "fox"])
    layers = tiny_embedder.info.num_layers
    at_once, calls = profiled(lambda: tiny_embedder.forward(batch, token_embeddings=True))
    assert calls.get(AT_ONCE) == layers and FLASH not in calls
    with mock.patch.object(attention, "SCORES_AT_ONCE_KEYS", 0):
        flash, calls = profiled(lambda: tiny_embedder.forward(batch, token_embeddings=True))
    assert calls.get(FLASH) == layers and AT_ONCE not in calls
    assert (at_once.pooled - flash.pooled).abs().max() < 1e-5
    assert at_once.token_embeddings is not None and flash.token_embeddings is not None
    for ours, theirs in zip(at_once.token_embeddings, flash.token_embeddings, strict=True):
        assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("width", [1, 7, SCORES_AT_ONCE_KEYS])
def test_short_inputs_on_a_cpu_take_every_score_at_once_and_agree_with_sdpa(width: int) -> None:
    """Padding, causality, a sliding window, a position bias and a scale: the context and the
    maps the same as the flash kernel's to float32's rounding."""
    q, k, v = qkv(3, 4, width)
    lengths = torch.tensor([width, max(1, width // 2), 1])
    padding = Mask(key_padding_mask((torch.arange(width) < lengths[:, None]).long()))
    # Each query up to itself: every one, padded or not, still sees the first token.
    causal = padding.narrowed(torch.ones(width, width, dtype=torch.bool).tril())
    window = Mask(torch.ones(3, 1, 1, width, dtype=torch.bool)).narrowed(
        sliding_window(width, 2, q.device)
    )
    bias = torch.randn(1, 4, width, width)
    cases: list[tuple[Mask, torch.Tensor | None, float | None]] = [
        (padding, None, None),
        (causal, None, None),
        (window, None, None),
        (padding, bias, 0.3),
    ]
    for mask, position_bias, scale in cases:
        call = functools.partial(attend, q, k, v, mask, bias=position_bias, scale=scale)
        (context, maps), calls = profiled(functools.partial(call, map_heads=(1, 2)))
        assert calls.get(AT_ONCE) == 1 and FLASH not in calls
        added = mask.added(q.dtype)
        assert added is not None
        if position_bias is not None:
            added = position_bias.masked_fill(~mask.allowed, float("-inf"))
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=added, scale=scale
        )
        assert (context - expected).abs().max() < 1e-5
        assert maps is not None and maps.shape == (3, 2, width, width)


@pytest.mark.usefixtures("two_threads")
def test_the_flash_kernel_keeps_what_every_score_at_once_does_not_win_or_cannot_do() -> None:
    """Long inputs, bfloat16, and queries with no key to attend to: an input without tokens,
    a sliding window over padding only (all zeros from the flash kernel, where a softmax of
    the scores alone gives NaN)."""
    long_q, long_k, long_v = qkv(2, 2, SCORES_AT_ONCE_KEYS + 1)
    every = Mask(torch.ones(2, 1, 1, SCORES_AT_ONCE_KEYS + 1, dtype=torch.bool))
    half_q, half_k, half_v = qkv(2, 2, 8, torch.bfloat16)
    half_every = Mask(torch.ones(2, 1, 1, 8, dtype=torch.bool))
    q, k, v = qkv(2, 4, 8)
    empty = Mask(key_padding_mask(torch.tensor([[1] * 8, [0] * 8])))
    one_token = Mask(key_padding_mask(torch.tensor([[1] * 8, [1] + [0] * 7])))
    window = one_token.narrowed(sliding_window(8, 2, q.device))
    assert not empty.every_query_sees_a_key and not window.every_query_sees_a_key
    for call in (
        lambda: attend(long_q, long_k, long_v, every),
        lambda: attend(half_q, half_k, half_v, half_every),
        lambda: attend(q, k, v, empty),
        lambda: attend(q, k, v, window),
    ):
        _, calls = profiled(call)
        assert AT_ONCE not in calls and calls[FLASH] == 1
    context, _ = attend(q, k, v, empty)
    assert context[1].eq(0).all() and context[0].isfinite().all()


def test_one_thread_takes_every_score_at_once_on_fewer_keys() -> None:
    """On one thread the flash kernel wins sooner: past SCORES_AT_ONCE_KEYS_ONE_THREAD."""
    assert SCORES_AT_ONCE_KEYS_ONE_THREAD < SCORES_AT_ONCE_KEYS
    for width, way in ((SCORES_AT_ONCE_KEYS_ONE_THREAD, AT_ONCE), (SCORES_AT_ONCE_KEYS, FLASH)):
        q, k, v = qkv(4, 4, width)
        every = Mask(torch.ones(4, 1, 1, width, dtype=torch.bool))
        with torch_threads(1):
            _, calls = profiled(functools.partial(attend, q, k, v, every))
        assert calls.get(way) == 1 and len({FLASH, AT_ONCE}.intersection(calls)) == 1
