"""The activation functions the encoders use, by this code's names, and the config spellings
that map to them."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Activation = Literal["gelu", "gelu_tanh", "relu"]

# Checkpoint spellings of the activations this code implements.
ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


def activate(x: Tensor, activation: Activation, *, in_place: bool = False) -> Tensor:
    """`activation(x)`; `in_place` overwrites `x`, a tensor no one else reads."""
    if activation == "relu":
        return F.relu(x, inplace=in_place)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    if in_place:
        gelu_: Tensor = torch.ops.aten.gelu_(x, approximate=approximate)
        return gelu_
    return F.gelu(x, approximate=approximate)
