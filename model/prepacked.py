"""The encoder's linear layers on a CPU, with their weights laid out once for oneDNN.

torch's `F.linear` takes weights in their checkpoint layout, so each call pays for fitting
them to the kernel: in bfloat16 oneDNN's own kernel, in float32 MKL's GEMM, slow on a few
rows. Laid out once at load, the same products run without that cost, which matters most
for small batches (`python -m bench.layers` compares; docs/benchmarks.md). bfloat16 gives the
same bits (oneDNN's kernel either way); float32 differs by rounding (the parity tests hold,
`tests/model/test_prepacked.py`).

A prepacked layer also takes the step after it into the same call where an encoder asks
(`linear_activated`, `linear_plus`): the activation, or the residual's addition, as oneDNN
post-ops: one pass over the output fewer. A product runs on its rows padded up to one of a
few counts (`bucket_rows`), so that oneDNN compiles a kernel for each of those instead of for
every batch's own token count.

Only where that was measured (`can_prepack`): on x86 with oneDNN, in float32, or in bfloat16
where oneDNN says the CPU supports it. `prepack=False` (`--no-prepack`) keeps torch's `F.linear`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.activations import Activation, activate

# The rows oneDNN lays the weights out for: a few sentences' tokens; any row count runs on
# it. A layout for one row made a single sentence slower, and one for many rows gained
# nothing on batches, so the layout suits the requests a server sees most.
EXPECTED_ROWS = 64
# The smallest float32 weight (in_features x out_features) laid out for oneDNN. Each
# prepacked call pays oneDNN a fixed cost (a primitive descriptor made anew), which a small
# product does not win back from MKL's GEMM (`python -m bench.layers`; docs/benchmarks.md);
# 2^17 keeps all-MiniLM-L6-v2's 384 x 384 layer, whose fused residual made the model faster.
# In bfloat16 `F.linear` lays the weight out on every call: a tiny bfloat16 model (32 wide)
# measured as fast or faster prepacked, so every size is.
MIN_PREPACKED_WEIGHTS = 1 << 17
# Row counts a product runs on, per doubling (a power of two, for `bucket_rows`). oneDNN
# compiles a kernel for every row count new to it (milliseconds) and keeps each in memory
# while its cache holds it: a server's batches, each with its own token count, would compile
# on most passes and hold hundreds of MiB of kernels. Rounded up to a few counts (padding
# rows of zeros, at most 1/16 more), they compile once each (docs/benchmarks.md).
ROW_BUCKETS = 16
FROZEN = "a prepacked linear layer cannot be {}: build the model with prepack=False"
# This code's activation names (model/activations.py) as oneDNN post-ops.
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def linear_activated(layer: nn.Module, x: Tensor, activation: Activation) -> Tensor:
    """`activation(layer(x))`, fused where the layer is prepacked."""
    if isinstance(layer, PrepackedLinear):
        return layer.activated(x, activation)
    return activate(layer(x), activation)


def linear_plus(layer: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """`layer(x) + residual`, fused where the layer is prepacked."""
    if isinstance(layer, PrepackedLinear):
        return layer.plus(x, residual)
    out: Tensor = layer(x) + residual
    return out


class PrepackedLinear(nn.Module):
    """`nn.Linear`'s product on a weight already in oneDNN's layout, for inference only (the
    op has no backward). The packed weight is an opaque oneDNN tensor, kept out of the
    parameters: this process's own (not shared between workers), and the bias stays an
    ordinary parameter. The layer is frozen: moving, converting or saving it raises, where
    the opaque weight would otherwise be skipped or fail deep inside oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), EXPECTED_ROWS)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        flat, rows = padded_rows(x)
        out: Tensor = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed, self.bias, "none", [], ""
        )
        return self._shaped(out, rows, x)

    def activated(self, x: Tensor, activation: Activation) -> Tensor:
        """The activation applied as the product's post-op: one pass over the output."""
        attr, algorithm = POST_OPS[activation]
        flat, rows = padded_rows(x)
        out: Tensor = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed, self.bias, attr, [], algorithm
        )
        return self._shaped(out, rows, x)

    def plus(self, x: Tensor, residual: Tensor) -> Tensor:
        """self(x) + residual, the addition as the product's post-op where the residual has
        the output's shape (else broadcast, as a separate step)."""
        if residual.shape != (*x.shape[:-1], self.out_features):
            broadcast: Tensor = self(x) + residual
            return broadcast
        flat, rows = padded_rows(x)
        added, _ = padded_rows(residual)
        out: Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            flat, added, self.packed, self.bias, "add"
        )
        return self._shaped(out, rows, x)

    def _shaped(self, out: Tensor, rows: int, x: Tensor) -> Tensor:
        """The product's output for `x`'s own rows, in `x`'s shape."""
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> NoReturn:
        raise RuntimeError(FROZEN.format("moved or converted"))

    def _save_to_state_dict(
        self, destination: Mapping[str, Any], prefix: str, keep_vars: bool
    ) -> NoReturn:
        raise RuntimeError(FROZEN.format("saved"))


def padded_rows(x: Tensor) -> tuple[Tensor, int]:
    """`x` as the (rows, features) a product runs on, padded with rows of zeros up to its
    bucket; and its own row count."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = bucket_rows(rows)
    return (flat if padded == rows else F.pad(flat, (0, 0, 0, padded - rows))), rows


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to one of ROW_BUCKETS sizes per doubling (exact below 2 x that):
    at most 1/ROW_BUCKETS more rows."""
    step = 1 << max(0, rows.bit_length() - ROW_BUCKETS.bit_length())
    return -(-rows // step) * step


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Where it was measured: x86 CPUs with oneDNN on (not ARM builds, whose oneDNN runs on
    other kernels), in float32, or in bfloat16 where oneDNN says the CPU supports it."""
    onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    onednn = onednn and torch.backends.mkldnn.enabled
    if device.type != "cpu" or not onednn or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def worth_prepacking(linear: nn.Linear) -> bool:
    """Whether oneDNN's layout gains more than its cost per call (MIN_PREPACKED_WEIGHTS)."""
    weight = linear.weight
    return weight.dtype != torch.float32 or weight.numel() >= MIN_PREPACKED_WEIGHTS


def prepack_linears(network: nn.Module) -> int:
    """Swap every `nn.Linear` inside `network` that is worth it for its prepacked twin; how
    many."""
    swapped = 0
    for module in list(network.modules()):
        for name, child in list(module.named_children()):
            # Exactly nn.Linear: a subclass may be read by its owner (MultiheadAttention
            # reads its out_proj.weight itself).
            if type(child) is nn.Linear and worth_prepacking(child):
                setattr(module, name, PrepackedLinear(child))
                swapped += 1
    return swapped
