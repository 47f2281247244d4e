"""The encoder's linear layers on a CPU, with their weights laid out once for the kernel.

torch's `F.linear` takes weights in their checkpoint layout, so each call pays for fitting
them to the kernel: in bfloat16 oneDNN's own kernel, in float32 MKL's GEMM, slow on a few
rows. Laid out once at load, the same products run without that cost, which matters most
for small batches (`python -m bench.layers` compares; docs/benchmarks.md). Two kernels:
- float32 on Intel CPUs (as Linux names the vendor): MKL's GEMM on its own packed layout
  (`MklLinear`), which measured faster than oneDNN in the whole model on one sentence and on
  batches, and pays no set-up per call;
- bfloat16, and float32 on other x86 CPUs (measured on AMD before MKL's packing was tried):
  oneDNN (`OnednnLinear`), which also takes the step after the product into the same call
  where an encoder asks (`linear_activated`, `linear_plus`): the activation, or the
  residual's addition, as oneDNN post-ops. Its product runs on its rows padded up to one of a
  few counts (`bucket_rows`), so that oneDNN compiles a kernel for each of those instead of
  for every batch's own token count.
bfloat16 gives the same bits as `F.linear` (oneDNN's kernel either way); float32 differs by
rounding (the parity tests hold, `tests/model/test_prepacked.py`).

Only where that was measured (`can_prepack`): on x86, in float32, or in bfloat16 where oneDNN
says the CPU supports it. `prepack=False` (`--no-prepack`) keeps torch's `F.linear`.
"""

from __future__ import annotations

import functools
import logging
import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.activations import Activation, activate
from model.device import cpu_vendor
from model.frozen import FrozenLinear, as_rows, shaped_like

log = logging.getLogger(__name__)

# The rows oneDNN lays a weight out for: a few sentences' tokens; any row count runs on it. A
# layout for one row made a single sentence slower, and one for many rows gained nothing on
# batches, so the layout suits the requests a server sees most. For MKL it only sizes the
# packed buffer.
EXPECTED_ROWS = 64
# The smallest float32 weight (in_features x out_features) packed for MKL: smaller products
# ran as fast on `F.linear` (`python -m bench.layers`; docs/benchmarks.md).
MIN_MKL_WEIGHTS = 1 << 16
# The same for oneDNN, whose every call pays a fixed cost (a primitive descriptor made anew)
# that a small product does not win back; 2^17 keeps all-MiniLM-L6-v2's 384 x 384 layer,
# whose fused residual made the model faster. In bfloat16 `F.linear` lays the weight out on
# every call: a tiny bfloat16 model (32 wide) measured as fast or faster prepacked, so every
# size is.
MIN_ONEDNN_FLOAT32_WEIGHTS = 1 << 17
# Row counts a oneDNN product runs on, per doubling (a power of two, for `bucket_rows`).
# oneDNN compiles a kernel for every row count new to it (milliseconds) and keeps each in
# memory while its cache holds it: a server's batches, each with its own token count, would
# compile on most passes and hold hundreds of MiB of kernels. Rounded up to a few counts
# (padding rows of zeros, at most 1/16 more), they compile once each (docs/benchmarks.md).
ROW_BUCKETS = 16
# This code's activation names (model/activations.py) as oneDNN post-ops.
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def linear_activated(layer: nn.Module, x: Tensor, activation: Activation) -> Tensor:
    """`activation(layer(x))`, fused where the layer's kernel can (not in a compiled pass,
    whose compiler fuses it)."""
    if isinstance(layer, PrepackedLinear) and not torch.compiler.is_compiling():
        return layer.activated(x, activation)
    return activate(layer(x), activation)


def linear_plus(layer: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """`layer(x) + residual`, fused where the layer's kernel can (not in a compiled pass,
    whose compiler fuses it)."""
    if isinstance(layer, PrepackedLinear) and not torch.compiler.is_compiling():
        return layer.plus(x, residual)
    out: Tensor = layer(x) + residual
    return out


class PrepackedLinear(FrozenLinear):
    """`nn.Linear`'s product on a weight already in a kernel's layout, for inference only (the
    ops have no backward). The packed weight is an opaque tensor, kept out of the parameters:
    this process's own (not shared between workers), and the bias stays an ordinary
    parameter."""

    refusal = "a prepacked linear layer cannot be {}: build the model with prepack=False"
    packed: Tensor

    def __init__(self, linear: nn.Linear, *, traceable: bool = False) -> None:
        """`traceable`: keep the checkpoint's weight too, for compiled passes
        (model/compiled.py), which trace `F.linear` on it and lay it out themselves (a
        packed weight is opaque to them)."""
        super().__init__(linear)
        self.bias = linear.bias
        self.weight = linear.weight if traceable else None

    def forward(self, x: Tensor) -> Tensor:
        # The weight asked first: an untraceable layer's eager pass pays no other question.
        if self.weight is not None and torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        return self._product(x)

    def _product(self, x: Tensor) -> Tensor:
        """The product on the packed weight."""
        raise NotImplementedError

    def activated(self, x: Tensor, activation: Activation) -> Tensor:
        """`activation(self(x))`, as each kernel does it best."""
        raise NotImplementedError

    def plus(self, x: Tensor, residual: Tensor) -> Tensor:
        """`self(x) + residual`: in the kernel's own way where the residual has the output's
        shape, else broadcast after the product."""
        if residual.shape == (*x.shape[:-1], self.out_features):
            return self._plus_same_shape(x, residual)
        out: Tensor = self(x) + residual
        return out

    def _plus_same_shape(self, x: Tensor, residual: Tensor) -> Tensor:
        raise NotImplementedError


class MklLinear(PrepackedLinear):
    """float32 on MKL's packed GEMM, on every call's own rows. The activation and the residual
    follow as steps of their own. MKL lays the weight out for the threads that pack it: load
    the model on the most threads a pass will run on (app/engine/model_engine.py does)."""

    def __init__(self, linear: nn.Linear, *, traceable: bool = False) -> None:
        super().__init__(linear, traceable=traceable)
        weight = linear.weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, EXPECTED_ROWS)
        # Told each call's own row count, the op takes MKL's packed path and reads the
        # checkpoint's weight for its shape only: a view of one zero stands in, and the weight
        # is freed (unless `traceable`). MKL's packed layout does not depend on the row count
        # (`agrees`, checked at load; test_prepacked). Off that path the op would multiply by
        # the stand-in, silently.
        self.weight_stand_in = weight.new_zeros(()).expand_as(weight)

    def _product(self, x: Tensor) -> Tensor:
        flat = as_rows(x)
        out: Tensor = torch.ops.mkl._mkl_linear(
            flat, self.packed, self.weight_stand_in, self.bias, flat.shape[0]
        )
        return shaped_like(out, x)

    def agrees(self, linear: nn.Linear) -> bool:
        """Whether the packed products equal `linear`'s on row counts off and on the one the
        weight was packed for: what passing each call's own count relies on."""
        numbers = torch.Generator().manual_seed(0)  # the global generator left alone
        with torch.inference_mode():
            for rows in (1, EXPECTED_ROWS, EXPECTED_ROWS + 3):
                x = torch.randn(rows, self.in_features, generator=numbers)
                if not torch.allclose(self(x), linear(x), rtol=1e-4, atol=1e-4):
                    return False
        return True

    def activated(self, x: Tensor, activation: Activation) -> Tensor:
        """The activation in place on the product's fresh output: no second tensor."""
        return activate(self(x), activation, in_place=True)

    def _plus_same_shape(self, x: Tensor, residual: Tensor) -> Tensor:
        """Added in place on the product's fresh output."""
        out: Tensor = self(x).add_(residual)
        return out


class OnednnLinear(PrepackedLinear):
    """The product in oneDNN, on its rows padded to their bucket, with the activation or the
    residual as a post-op."""

    def __init__(self, linear: nn.Linear, *, traceable: bool = False) -> None:
        super().__init__(linear, traceable=traceable)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), EXPECTED_ROWS)

    def _product(self, x: Tensor) -> Tensor:
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

    def _plus_same_shape(self, x: Tensor, residual: Tensor) -> Tensor:
        """The addition as the product's post-op, on rows padded alike."""
        flat, rows = padded_rows(x)
        added, _ = padded_rows(residual)
        out: Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            flat, added, self.packed, self.bias, "add"
        )
        return self._shaped(out, rows, x)

    def _shaped(self, out: Tensor, rows: int, x: Tensor) -> Tensor:
        """The product's output for `x`'s own rows (mostly all of them: on a bucket, no
        slice), in `x`'s shape."""
        return shaped_like(out if out.shape[0] == rows else out[:rows], x)


def padded_rows(x: Tensor) -> tuple[Tensor, int]:
    """`x` as the (rows, features) a product runs on, padded with rows of zeros up to its
    bucket; and its own row count."""
    flat = as_rows(x)
    rows = flat.shape[0]
    padded = bucket_rows(rows)
    if padded == rows:
        return flat, rows
    # A copy either way; `cat` made it in two thirds of `F.pad`'s time (docs/benchmarks.md).
    return torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])]), rows


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to one of ROW_BUCKETS sizes per doubling (exact below 2 x that):
    at most 1/ROW_BUCKETS more rows."""
    step = 1 << max(0, rows.bit_length() - ROW_BUCKETS.bit_length())
    return -(-rows // step) * step


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Where it was measured: x86 CPUs (not ARM builds, whose kernels are others), in float32
    with MKL or oneDNN on, or in bfloat16 where oneDNN says the CPU supports it."""
    if device.type != "cpu" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if dtype == torch.float32 and mkl_packs_float32():
        return True
    onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not (onednn and torch.backends.mkldnn.enabled):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


@functools.cache
def mkl_packs_float32() -> bool:
    """float32 on MKL's packing: on Intel CPUs, where it was measured, with MKL in torch (the
    op takes its packed weight as a oneDNN tensor, so oneDNN must be built in too)."""
    mkl = torch.backends.mkl.is_available()  # type: ignore[no-untyped-call]
    onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return bool(mkl and onednn) and cpu_vendor() == "GenuineIntel"


def packed_twin(linear: nn.Linear, *, traceable: bool = False) -> PrepackedLinear | None:
    """`linear` on the kernel that runs its dtype here, or None where it is not worth it;
    `traceable`: see PrepackedLinear."""
    size = linear.weight.numel()
    if linear.weight.dtype != torch.float32:
        return OnednnLinear(linear, traceable=traceable)
    if not mkl_packs_float32():
        if size < MIN_ONEDNN_FLOAT32_WEIGHTS:
            return None
        return OnednnLinear(linear, traceable=traceable)
    if size < MIN_MKL_WEIGHTS:
        return None
    twin = MklLinear(linear, traceable=traceable)
    if twin.agrees(linear):
        return twin
    log.warning("MKL's packed products differ from torch's here: F.linear instead")
    return None


def kernel_names(network: nn.Module) -> str:
    """The kernels `network`'s prepacked layers run on, by class name, for the log."""
    names = {type(m).__name__ for m in network.modules() if isinstance(m, PrepackedLinear)}
    return ", ".join(sorted(names))


def prepack_linears(network: nn.Module, *, traceable: bool = False) -> int:
    """Swap every `nn.Linear` inside `network` that is worth it for its prepacked twin; how
    many. `traceable`: see PrepackedLinear."""
    swapped = 0
    for module in list(network.modules()):
        for name, child in list(module.named_children()):
            # Exactly nn.Linear: a subclass may be read by its owner (MultiheadAttention
            # reads its out_proj.weight itself).
            if type(child) is not nn.Linear:
                continue
            twin = packed_twin(child, traceable=traceable)
            if twin is not None:
                setattr(module, name, twin)
                swapped += 1
    return swapped
