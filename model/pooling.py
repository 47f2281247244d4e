"""Pooling of per-token states into one vector, normalisation and Matryoshka truncation."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.errors import ConfigError


class Pooling(enum.StrEnum):
    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    LAST_TOKEN = "last_token"


# sentence-transformers' 1_Pooling/config.json flags for the modes implemented here.
_FLAGS = {
    "pooling_mode_mean_tokens": Pooling.MEAN,
    "pooling_mode_cls_token": Pooling.CLS,
    "pooling_mode_max_tokens": Pooling.MAX,
    "pooling_mode_lasttoken": Pooling.LAST_TOKEN,
}
_UNSUPPORTED_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def pooling_from_config(raw: Mapping[str, Any], source: str) -> Pooling:
    """Read the one pooling mode a `1_Pooling/config.json` turns on."""
    for flag in _UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ConfigError(f"{source}: unsupported pooling flag {flag!r}")
    modes = [mode for flag, mode in _FLAGS.items() if raw.get(flag)]
    if len(modes) != 1:
        raise ConfigError(
            f"{source}: exactly one of {', '.join(_FLAGS)} must be true, found {len(modes)}"
        )
    return modes[0]


def pool(hidden: Tensor, attention_mask: Tensor, mode: Pooling) -> Tensor:
    """(B, T, D) states and (B, T) 1/0 mask -> (B, D); padding never contributes."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if mode is Pooling.CLS:
        return hidden[:, 0]
    if mode is Pooling.LAST_TOKEN:
        # Inputs are right-padded, so the last real token sits at length - 1.
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if mode is Pooling.MAX:
        filled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min)
        # An input with no real token pools to zeros rather than to finfo.min.
        return filled.max(dim=1).values * (mask.sum(dim=1) > 0)
    summed = (hidden * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1e-9)


def finalize(vectors: Tensor, normalize: bool, dimensions: int | None = None) -> Tensor:
    """Matryoshka: keep the first `dimensions` features, then L2-normalise if asked."""
    if dimensions is not None:
        vectors = vectors[..., :dimensions]
    if normalize:
        vectors = F.normalize(vectors, p=2, dim=-1)
    return vectors
