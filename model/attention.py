"""Scaled dot-product attention with a padding mask, written once for every architecture.

Mask rule: `attention_mask` is (B, T) with 1 for a real token and 0 for padding. It hides
padded *keys* and broadcasts as (B, 1, 1, T) over heads and queries. An architecture that
restricts attention further (ModernBERT's sliding window) passes a narrower boolean mask that
still broadcasts to (B, H, T, T); one that adds a position bias (MPNet) passes it as `bias`.

The context comes from `scaled_dot_product_attention`, or, on a CPU, for short float32
inputs with no query masked whole, from every score at once (`SCORES_AT_ONCE_KEYS`, over keys
padded to `KEY_LANES`); either way asking for attention maps never changes the hidden states.
The maps are computed beside it, from the same scores, for the heads asked for only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# On a CPU torch's flash kernel works through each sequence and head on its own, in blocks,
# and on short inputs that costs more than computing all the scores at once: one batched
# product, a softmax, one more product. Up to this many keys that measured faster on two
# threads; on one thread, up to SCORES_AT_ONCE_KEYS_ONE_THREAD (`python -m bench.attention`;
# docs/benchmarks.md). The scores take B x H x T x T floats.
SCORES_AT_ONCE_KEYS = 48
SCORES_AT_ONCE_KEYS_ONE_THREAD = 32
# torch's softmax over a last dimension runs whole vectors of it at once and the rest one
# value at a time, at many times the cost: over 13 keys it took about 8x as long as over 16.
# So every score at once over fewer keys than this (one AVX-512 vector of floats, two AVX2
# ones), but at least half as many, runs over this many, the padding's scores -inf: the
# softmax gives them exact zeros, and they are dropped before the context. Fewer keys, or
# more (whose rest past whole vectors is a smaller share), measured no faster padded
# (`python -m bench.attention`; docs/benchmarks.md).
KEY_LANES = 16


def key_padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 1/0 mask -> (B, 1, 1, T) bool, True where a key may be attended to."""
    return attention_mask.bool()[:, None, None, :]


def sliding_window(width: int, window: int, device: torch.device) -> Tensor:
    """(T, T) bool: True where query and key are at most `window` positions apart."""
    position = torch.arange(width, device=device)
    return (position[None, :] - position[:, None]).abs() <= window


@dataclass(frozen=True)
class MapRequest:
    """Which attention probabilities a forward pass keeps: these layers, these heads."""

    layers: frozenset[int]
    heads: tuple[int, ...]

    def wants(self, layer: int) -> bool:
        return layer in self.layers


NO_MAPS = MapRequest(frozenset(), ())


class Mask:
    """Where queries may attend in one pass, shared by its layers: a boolean tensor
    broadcastable to (B, H, T, T), and what SDPA adds to the scores for it, made once per
    dtype (and padded keys, `added`) on first use. Handed the boolean tensor, SDPA would
    convert it in every layer (two `where` calls a layer, a few percent of one sentence's
    pass on a CPU).

    `hides_nothing`: every key of every input may be attended to (a batch without padding,
    which a single sentence always is), known where the mask was read anyway. Attention then
    runs with no mask at all, which gives the same scores (adding zero is exact) without
    making the mask or asking it whether a row is masked whole, several calls a pass."""

    __slots__ = ("_added", "_every_query_sees_a_key", "allowed", "hides_nothing")

    def __init__(self, allowed: Tensor, *, hides_nothing: bool = False) -> None:
        self.allowed = allowed
        self.hides_nothing = hides_nothing
        self._added: dict[tuple[torch.dtype, int], Tensor] = {}
        self._every_query_sees_a_key: bool | None = True if hides_nothing else None

    def narrowed(self, narrower: Tensor) -> Mask:
        """This mask further restricted (a sliding window, causality): a mask of its own. A
        method, not `&`: torch.compile cannot trace an operator a class of its own defines."""
        return Mask(self.allowed & narrower)

    def added(self, dtype: torch.dtype, keys: int | None = None) -> Tensor | None:
        """0 where a key may be attended to, -inf elsewhere; None where that is everywhere.
        `keys` past the mask's own width: that many columns, the ones past it -inf (keys
        padded for the softmax, which no query may attend to)."""
        width = self.allowed.shape[-1]
        keys = keys or width
        if self.hides_nothing and keys == width:
            return None
        if torch.compiler.is_compiling():  # its sizes are symbols, which key no dictionary
            return self._make_added(dtype, keys)
        if (added := self._added.get((dtype, keys))) is None:
            added = self._added[(dtype, keys)] = self._make_added(dtype, keys)
        return added

    def _make_added(self, dtype: torch.dtype, keys: int) -> Tensor:
        width = self.allowed.shape[-1]
        shape = (*self.allowed.shape[:-1], keys)
        added = torch.zeros(shape, dtype=dtype, device=self.allowed.device)
        if not self.hides_nothing:
            added[..., :width].masked_fill_(~self.allowed, float("-inf"))
        if keys > width:
            added[..., width:] = float("-inf")
        return added

    @property
    def every_query_sees_a_key(self) -> bool:
        """No row of the scores is masked whole (an input with no tokens; a sliding window
        over padding only), where a softmax of the scores alone would give NaN."""
        if self._every_query_sees_a_key is None:
            self._every_query_sees_a_key = bool(self.allowed.any(-1).all())
        return self._every_query_sees_a_key


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    bias: Tensor | None = None,
    scale: float | None = None,
    map_heads: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(B, H, T, hd) q, k, v -> (B, H, T, hd) context, and (B, h, T, T) probabilities of the
    `map_heads` (h of them) when asked for.

    `mask` says which keys each query may attend to; `bias` is added to the scores.
    Probabilities of disallowed keys are exactly 0, and a row with no allowed key is all
    zeros (never NaN), as the context of such a row is.
    """
    allowed = mask.allowed
    factor = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    if _scores_at_once(q, k, mask):
        keys = padded_keys(k.shape[-2])
        context = context_of_all_scores(q, k, v, _added(mask, bias, q.dtype, keys), factor)
    else:
        added = _added(mask, bias, q.dtype)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=added, scale=scale)
    if map_heads is None:
        return context, None
    heads = list(map_heads)
    scores = (q[:, heads] @ k[:, heads].transpose(-2, -1)).float() * factor  # (B, h, T, T)
    if bias is not None:
        scores = scores + (bias[:, heads] if bias.shape[1] > 1 else bias).float()
    heads_allowed = allowed[:, heads] if allowed.shape[1] > 1 else allowed
    scores = scores.masked_fill(~heads_allowed, torch.finfo(torch.float32).min)
    # Softmax in float32 as the references do; zeroing disallowed keys afterwards makes a row
    # with no allowed key all zeros instead of a uniform distribution.
    probs = F.softmax(scores, dim=-1) * heads_allowed
    return context, probs


def _scores_at_once(q: Tensor, k: Tensor, mask: Mask) -> bool:
    """Where every score at once is the faster way to the context (`SCORES_AT_ONCE_KEYS`):
    float32 on a CPU, short inputs, and no query whose keys are all masked. Only the mask is
    asked: a position bias (MPNet's, ALiBi's) is finite everywhere. Never in a compiled pass
    (model/compiled.py), whose graph cannot ask the mask."""
    if torch.compiler.is_compiling():  # first: a comparison of sizes would tie the graph
        return False
    if q.device.type != "cpu" or q.dtype != torch.float32 or q.shape[-2] != k.shape[-2]:
        return False
    limit = SCORES_AT_ONCE_KEYS if torch.get_num_threads() > 1 else SCORES_AT_ONCE_KEYS_ONE_THREAD
    return k.shape[-2] <= limit and mask.every_query_sees_a_key


def padded_keys(width: int) -> int:
    """The keys every score at once runs over for `width` of them (`KEY_LANES`)."""
    return KEY_LANES if KEY_LANES // 2 <= width < KEY_LANES else width


def _added(
    mask: Mask, bias: Tensor | None, dtype: torch.dtype, keys: int | None = None
) -> Tensor | None:
    """What the scores get added over `keys` columns (`Mask.added`): the mask's, plus the
    bias where there is one (its padded columns 0 before the mask's -inf)."""
    added = mask.added(dtype, keys)
    if bias is None:
        return added
    bias = bias.to(dtype)
    if keys is not None and keys > bias.shape[-1]:
        bias = F.pad(bias, (0, keys - bias.shape[-1]))
    return bias if added is None else bias + added


def context_of_all_scores(
    q: Tensor, k: Tensor, v: Tensor, added: Tensor | None, scale: float
) -> Tensor:
    """(B, H, T, hd) context: softmax(q k^T x scale + added) v, as three batched steps.
    `added` may run over more keys than `k` has (`Mask.added`'s padding): `k` is padded with
    zeros to as many, and their probabilities, exact zeros, dropped before the context."""
    batch, heads, width, depth = q.shape
    rows = batch * heads
    keys = width if added is None else added.shape[-1]
    if keys > width:  # one copy, as the reshape below would make of the view anyway
        k = F.pad(k, (0, 0, 0, keys - width))
    if added is None:  # beta 0: nothing added, the very scores that adding zeros gives
        grid, beta = q.new_zeros(()), 0.0
    else:
        grid, beta = added.expand(batch, heads, width, keys).reshape(rows, width, keys), 1.0
    scores = torch.baddbmm(
        grid,
        q.reshape(rows, width, depth),
        k.reshape(rows, keys, depth).transpose(1, 2),
        beta=beta,
        alpha=scale,
    )
    probs = scores.softmax(-1)
    if keys > width:
        probs = probs[..., :width]
    context = torch.bmm(probs, v.reshape(rows, width, v.shape[-1]))
    return context.view(batch, heads, width, v.shape[-1])
