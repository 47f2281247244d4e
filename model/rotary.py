"""Rotary position embeddings (RoPE), as the rotary architectures here share them.

The tables are computed per forward pass for the batch's width, in float32 (transformers
computes them in float32 too), then rounded to the model's dtype; queries and keys turn in
float32. Rows are right-padded, so every row's positions start at 0. Pairs are the two halves
of a head (transformers' `rotate_half` layout), not interleaved neighbours.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotary_tables(
    theta: float, head_dim: int, width: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(T, hd) cos and sin for positions 0..T-1 (every row starts at 0: padding is on the
    right). The frequencies are computed here in float32, not kept in a buffer that `.to(dtype)`
    would round to half precision (transformers keeps them in float32 too); the tables are
    rounded to the model's dtype as transformers rounds them."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    position = torch.arange(width, device=device, dtype=torch.float)
    angles = position[:, None] * inverse[None, :]  # (T, hd / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd): both halves of a pair turn alike
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(B, H, T, hd) queries or keys turned by their positions, in float32."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    turned = x32 * cos + torch.cat((-second, first), dim=-1) * sin
    return turned.to(x.dtype)
