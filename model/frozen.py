"""Linear layers whose weight is laid out for one kernel (model/prepacked.py, model/int8.py),
often in an opaque packed tensor, which therefore refuse to be moved, converted or saved."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn

from torch import Tensor, nn


def as_rows(x: Tensor) -> Tensor:
    """`x` as the (rows, features) a product runs on. The encoders' tokens come packed, (N, D):
    then `x` itself, with no call to reshape it, which costs more than the smallest products."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def shaped_like(out: Tensor, x: Tensor) -> Tensor:
    """A product's contiguous (rows, out) output in `x`'s leading shape (`as_rows` undone)."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


class FrozenLinear(nn.Module):
    """`nn.Linear`'s shape on an opaque packed weight, for inference only. Moving, converting
    or saving the layer raises `refusal` (formatted with what was tried), where the opaque
    weight would otherwise be skipped, or fail deep inside its kernel."""

    refusal: ClassVar[str] = "a packed linear layer cannot be {}"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> NoReturn:
        raise RuntimeError(self.refusal.format("moved or converted"))

    def _save_to_state_dict(
        self, destination: Mapping[str, Any], prefix: str, keep_vars: bool
    ) -> NoReturn:
        raise RuntimeError(self.refusal.format("saved"))
