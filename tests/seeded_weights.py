"""Random weights made from key names and shapes alone, for reference fixtures.

The architectures whose code lives only with their weights (NomicBERT, GTE, JinaBERT) are
checked against numbers their authors' code produced, outside this project, on weights made by
this same rule; the tests make them again from the fixture's seed and this encoder's own keys.
Each tensor has a generator of its own, seeded by the key's CRC-32 started from the seed (a
32-bit value: torch's CPU generator keeps only 32 bits of a seed), so that the order in which
either side lists its keys does not matter.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

SCALE = 0.5  # as tests/helpers.py scales its random checkpoints


def seeded_weights(shapes: Mapping[str, Sequence[int]], seed: int) -> dict[str, Tensor]:
    """float32 tensors, standard normal times SCALE, one per key."""
    weights = {}
    for key, shape in shapes.items():
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode(), seed & 0xFFFFFFFF))
        weights[key] = torch.randn(tuple(shape), generator=generator) * SCALE
    return weights
