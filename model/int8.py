"""The encoder's linear layers in int8 on a CPU, for the operator who asks for it (`--dtype int8`).

Dynamic quantization: each weight is quantized once at load, per output channel (symmetric,
one scale per row), and each call quantizes its activations from their own range. Two
kernels, by how the passes run:
- eager passes (`Int8Linear`): torch's fbgemm kernel, which quantizes a call's activations
  per tensor, over all its rows, inside one op;
- compiled passes (`--compile`, model/compiled.py; `RowwiseInt8Linear`): the activations
  quantized per row (each token from its own range) in a few plain ops, the product in
  `torch._int_mm` (oneDNN: AMX or VNNI where the CPU has them), and the scales and bias
  applied after. Inductor fuses the quantizing and the scaling into the kernels around the
  product. A token's vector no longer depends on the rows beside it (other inputs, or a
  padded grid's padding), so every batch can run on a graph, and each token keeps its own
  range: closer to float32 than fbgemm's ranges (docs/benchmarks.md). Eagerly the same
  steps are a dozen small ops a product, too slow to replace fbgemm's one.
Everything else (embeddings, attention, LayerNorm, the activation functions, pooling and any
head) stays in float32. Never chosen by `auto`: it trades a little accuracy for speed, and
docs/benchmarks.md says how much of each.

On CPUs without AVX-512 VNNI the weights use 7 bits (`NARROW_LEVELS`), so that 16-bit sums of
products cannot saturate; fbgemm's activations keep their 8 bits, the row-wise layer's take 7
too (oneDNN may shift either operand to unsigned there).
"""

from __future__ import annotations

import platform
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from model.frozen import FrozenLinear, as_rows, shaped_like

INT8 = "int8"
# The CPU flag of the instructions (AVX-512 VNNI) that fbgemm multiplies 8-bit integers with,
# summing into 32 bits, where it has them. AVX-VNNI without AVX-512 (Intel's client CPUs) it
# does not use: there it runs its AVX2 kernels.
VNNI_FLAG = "avx512_vnni"
# Levels each side of zero a weight is quantized to, with one scale per output channel.
FULL_LEVELS = 127
# Elsewhere fbgemm multiplies uint8 activations by int8 weights in pairs summed into 16 bits
# (vpmaddubsw), which saturate beyond 32,767: 2 x 255 x 63 fits, 2 x 255 x 127 does not
# (oneDNN shifts signed activations to unsigned ones for the same instruction).
# There the weights give up their eighth bit rather than the activations (torch's
# `reduce_range`, whose one scale covers a whole tensor): all-MiniLM-L6-v2 measured much
# closer to float32 so (docs/benchmarks.md).
NARROW_LEVELS = 63


@contextmanager
def _quantized_tensors_allowed() -> Iterator[None]:
    """torch warns that quantized tensors will be removed; the kernels used here have no
    replacement in torch itself yet, and a warning per layer at start-up helps nobody."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per", category=UserWarning)
        yield


# The least scale: a row or channel of zeros quantizes to zeros.
LEAST_SCALE = 1e-12


def channel_scales(weight: Tensor, levels: int) -> Tensor:
    """One scale per output channel (row of `weight`), its largest weight on the top level."""
    return (weight.abs().amax(dim=1) / levels).clamp(min=LEAST_SCALE)


class Int8Linear(FrozenLinear):
    """`nn.Linear` with int8 weights (per output channel) and activations quantized per call,
    over all its rows, by fbgemm. The packed weight is an opaque fbgemm object."""

    refusal = "an int8 linear layer cannot be {}: build the model in a float dtype"

    def __init__(self, linear: nn.Linear, levels: int) -> None:
        super().__init__(linear)
        self.levels = levels
        weight = linear.weight.detach().float()
        scales = channel_scales(weight, levels).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().float()
        with _quantized_tensors_allowed():
            quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, bias)
        # The op itself, as torch.ops' wrapper calls it (looked up here, where the kernels are
        # known to exist). The wrapper of an op that takes a packed object first walks every
        # argument in Python for the fake objects torch.compile traces with, none of which an
        # inference pass has: that walk was 8% of the instructions of a small model's int8
        # pass (docs/benchmarks.md).
        self.product = torch.ops.quantized.linear_dynamic.default._op

    def forward(self, x: Tensor) -> Tensor:
        # With subclass dispatch on, torch asks every argument for `__torch_function__`; the
        # packed weight (a ScriptObject) answers by throwing a C++ exception, caught again,
        # which cost 40% of a small call. Plain tensors go in, so nothing is lost.
        with torch._C.DisableTorchFunctionSubclass():
            out: Tensor = self.product(as_rows(x), self.packed, False)
        return shaped_like(out, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8 (weights within +-{self.levels})"


class RowwiseInt8Linear(FrozenLinear):
    """`nn.Linear` with int8 weights (per output channel) and each row of activations
    quantized from its own range, in plain ops that a compiled pass traces and fuses around
    `torch._int_mm`. The weights are parameters, so that a graph freezes them."""

    refusal = Int8Linear.refusal

    def __init__(self, linear: nn.Linear, levels: int) -> None:
        super().__init__(linear)
        self.levels = levels
        weight = linear.weight.detach().float()
        scales = channel_scales(weight, levels)
        self.weight = nn.Parameter(torch.round(weight / scales[:, None]).to(torch.int8), False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        rows = as_rows(x)
        # The weights' levels: 7 bits each side where 16-bit sums could saturate, whichever
        # operand oneDNN shifts to unsigned there.
        steps = (rows.abs().amax(dim=1, keepdim=True) / self.levels).clamp(min=LEAST_SCALE)
        quantized = torch.round(rows / steps).to(torch.int8)
        # As float32 before the scaling: eagerly, mixed dtypes take a slow path.
        sums = torch._int_mm(quantized, self.weight.t()).float()
        # Not `sums * steps * scales + bias`, which inductor turns into oneDNN's qlinear op:
        # slower on a sentence's rows (docs/benchmarks.md).
        scaled = steps * self.scales
        out = sums * scaled if self.bias is None else torch.addcmul(self.bias, sums, scaled)
        return shaped_like(out, x)

    def extra_repr(self) -> str:
        levels = self.levels
        return f"{super().extra_repr()}, int8 per row (weights and activations within +-{levels})"


def int8_unavailable(device: torch.device) -> str | None:
    """Why int8 cannot run here, or None where it can."""
    if device.type != "cpu":
        return f"int8 runs on the CPU only, not on {device.type}: use float16 there"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"int8 needs torch's fbgemm kernels, which run on x86 CPUs, not {platform.machine()}"
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "int8 needs torch's fbgemm kernels, which this build of torch lacks"
    return None


def weight_levels(cpu_flags: frozenset[str]) -> int:
    """The levels a weight may use on a CPU with these flags."""
    return FULL_LEVELS if VNNI_FLAG in cpu_flags else NARROW_LEVELS


def quantize_linears(network: nn.Module, levels: int, *, rowwise: bool = False) -> int:
    """Swap every `nn.Linear` inside `network` (float32) for its int8 twin, row-wise for
    compiled passes; how many."""
    twin = RowwiseInt8Linear if rowwise else Int8Linear
    swapped = 0
    for module in list(network.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:  # exactly: a subclass may be read by its owner
                setattr(module, name, twin(child, levels))
                swapped += 1
    return swapped
