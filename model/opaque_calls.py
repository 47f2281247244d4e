"""Layers that a compiled pass (model/compiled.py) calls rather than traces.

int8's product takes its weight as an opaque fbgemm object (model/int8.py), which torch.compile
cannot trace. Such a layer registers itself here and, under compilation, calls the one custom
op `embed::opaque_linear(rows, key)`, which runs the registered layer's own eager product on
`rows` (N, in_features). The graph holds the key, a constant, and inductor fuses everything
between these calls. Defined with `torch.library.Library` and a plain function: through
`torch.library.custom_op`'s wrapper each call cost several microseconds more, on 24 calls a
sentence (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch
from torch import Tensor

OP = "opaque_linear"


class OpaqueLinear(Protocol):
    out_features: int

    def rows_product(self, rows: Tensor) -> Tensor:
        """The layer's product on (N, in_features) rows: (N, out_features)."""
        ...


# Keys to layers, held weakly: a layer lives as long as its network (whose graphs call it by
# key), not as long as this table.
_layers: weakref.WeakValueDictionary[int, OpaqueLinear] = weakref.WeakValueDictionary()
_keys = itertools.count()

_library = torch.library.Library("embed", "DEF")  # type: ignore[no-untyped-call]
_library.define(f"{OP}(Tensor rows, int key) -> Tensor")  # type: ignore[no-untyped-call]


def register(layer: OpaqueLinear) -> int:
    """The key a graph calls `layer` by."""
    key = next(_keys)
    _layers[key] = layer
    return key


def call(rows: Tensor, key: int) -> Tensor:
    """The registered layer's product on `rows`, as a graph records it."""
    out: Tensor = torch.ops.embed.opaque_linear(rows, key)
    return out


def _product(rows: Tensor, key: int) -> Tensor:
    return _layers[key].rows_product(rows)


def _traced_shape(rows: Tensor, key: int) -> Tensor:
    """What torch.compile traces the call with: the output's shape, no values."""
    return rows.new_empty((rows.shape[0], _layers[key].out_features))


_library.impl(OP, _product, "CPU")  # type: ignore[no-untyped-call]
torch.library.register_fake(f"embed::{OP}", _traced_shape, lib=_library)
