"""Running position-wise layers on the real tokens of a padded batch only.

When padding is a large share of a batch, the position-wise layers (projections,
feed-forward, LayerNorm: most of the FLOPs) run on the N real tokens, packed as (N, D), and
only attention sees the padded (B, T) grid. When a batch is mostly padding-free, gathering
and scattering would cost more than it saves, and everything runs on the grid.

On a GPU the layers always run on the grid: padded rows cost the GPU little, while packing
adds kernel launches and reads the mask back to the CPU, which waits for the GPU to get there,
so a packed pass is slower there at every batch measured (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from model.attention import Mask, key_padding_mask

# Below this share of padding, gathering and scattering the real tokens costs as much as the
# padded rows save (`python -m bench.layers`; docs/benchmarks.md).
PACKING_MIN_PADDING = 0.1


@dataclass(frozen=True)
class TokenLayout:
    """Where the real tokens of a padded (B, T) batch sit."""

    batch: int
    width: int
    # Flat positions of the real tokens, (N,); None when the layers run on the whole grid.
    index: Tensor | None
    key_mask: Mask  # (B, 1, 1, T)

    @classmethod
    def from_mask(cls, attention_mask: Tensor) -> TokenLayout:
        batch, width = attention_mask.shape
        index = None
        # On a GPU the mask is not read back (that would wait for the device), nor in a
        # compiled pass (model/compiled.py), whose graph cannot depend on its values: their
        # layers always run on the grid, with the mask. But a compiled single input hides
        # nothing: its graph is its own (torch.compile specialises a size of 1), and only an
        # unpadded row runs on it (`CompiledNetwork.fits`).
        hides_nothing = False
        if torch.compiler.is_compiling():
            # An int only where the size is specialised: `batch == 1` on a symbol would be a
            # symbolic comparison of its own.
            hides_nothing = isinstance(batch, int) and batch == 1
        elif attention_mask.device.type == "cpu":
            flat = attention_mask.reshape(-1).bool()
            padded = flat.numel() - int(flat.sum())
            hides_nothing = padded == 0
            if padded >= PACKING_MIN_PADDING * flat.numel():
                index = flat.nonzero().squeeze(1)
        mask = Mask(key_padding_mask(attention_mask), hides_nothing=hides_nothing)
        return cls(batch, width, index, mask)

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, F) -> (N, F): the real tokens only (all B x T of them when unpacked)."""
        return self._real_rows(x.reshape(self.batch * self.width, x.shape[-1]))

    def unpack(self, x: Tensor) -> Tensor:
        """(N, F) -> (B, T, F); padded positions hold no meaningful values."""
        if self.index is None:
            return x.view(self.batch, self.width, x.shape[-1])
        grid = x.new_zeros(self.batch * self.width, x.shape[-1])
        grid.index_copy_(0, self.index, x)
        return grid.view(self.batch, self.width, x.shape[-1])

    def heads(self, x: Tensor, num_heads: int) -> Tensor:
        """(N, D) packed -> (B, H, T, D / H), the grid attention runs on."""
        # Unpacked, x is the grid already: viewed once, not through `unpack`'s view too.
        grid = x if self.index is None else self.unpack(x)
        return grid.view(self.batch, self.width, num_heads, -1).transpose(1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, H, T, hd) -> (N, H x hd) packed."""
        return self._real_rows(x.transpose(1, 2).reshape(self.batch * self.width, -1))

    def _real_rows(self, flat: Tensor) -> Tensor:
        """(B x T, F) -> (N, F)."""
        return flat if self.index is None else flat.index_select(0, self.index)


# Tokens whose feed-forward runs at once on the CPU: the 4x-wide intermediate then stays in
# cache instead of going out to memory and back (`python -m bench.layers`; docs/benchmarks.md).
FEED_FORWARD_CHUNK = 1024


def in_row_chunks(function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Apply a row-wise function to (N, D) tokens, FEED_FORWARD_CHUNK rows at a time on CPU."""
    # A compiled pass (model/compiled.py) runs whole, and asked first: its row count is a
    # symbol, and a comparison of it would tie the graph to the answer.
    rows = x.shape[0]
    if torch.compiler.is_compiling() or x.device.type != "cpu" or rows <= FEED_FORWARD_CHUNK:
        return function(x)
    out = torch.empty_like(x)
    for start in range(0, rows, FEED_FORWARD_CHUNK):
        stop = start + FEED_FORWARD_CHUNK
        out[start:stop] = function(x[start:stop])
    return out
