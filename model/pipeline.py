"""The steps after the encoder: pooling, Dense layers and normalisation, then the cut.

This is one `EmbeddingPipeline`, described by the model folder (model/folder.py reads it):
sentence-transformers' Pooling (every mode, several at once concatenated in its order,
prompt tokens left out when `include_prompt` is false), its Dense layers and Normalize
modules in order, then the folder's `truncate_dim` cut. What a request adds comes last:
`finish` (model/vectors.py) keeps the first `dimensions` features (Matryoshka), then
L2-normalises if asked.

Everything here runs in float32, whatever the encoder's dtype: sums over hundreds of tokens
in half precision lose digits, and a float16 `clamp(min=1e-9)` underflows to zero.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class PoolingMode(enum.StrEnum):
    """sentence-transformers' pooling modes, in the order it concatenates them."""

    CLS = "cls"
    MAX = "max"
    MEAN = "mean"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    WEIGHTED_MEAN = "weightedmean"
    LAST_TOKEN = "lasttoken"


@dataclass(frozen=True)
class Pooling:
    modes: tuple[PoolingMode, ...] = (PoolingMode.MEAN,)
    # False: the prompt's tokens (with the leading special token) are left out of the pooling.
    include_prompt: bool = True

    def __call__(self, hidden: Tensor, attention_mask: Tensor, prompt_lengths: Tensor) -> Tensor:
        """(B, T, D) states, (B, T) right-padded 1/0 mask, (B,) prompt lengths -> (B, m x D)."""
        hidden = hidden.float()
        mask = attention_mask
        if not self.include_prompt:
            # Arithmetic, not a boolean index: that reads the mask back to the CPU, which a
            # CUDA graph cannot capture.
            positions = torch.arange(mask.shape[1], device=mask.device)
            mask = mask * (positions >= prompt_lengths.unsqueeze(1))
        weights = mask.unsqueeze(-1).float()  # (B, T, 1)
        count = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1)
        pooled = [self._pool(mode, hidden, mask, weights, count) for mode in self.modes]
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)

    @staticmethod
    def _pool(
        mode: PoolingMode, hidden: Tensor, mask: Tensor, weights: Tensor, count: Tensor
    ) -> Tensor:
        if mode is PoolingMode.CLS:
            # The first token the mask keeps: [CLS], or the first after an excluded prompt.
            return hidden[_rows(hidden), mask.int().argmax(dim=1)]
        if mode is PoolingMode.LAST_TOKEN:
            width = mask.shape[1]
            found, from_end = mask.flip(1).max(dim=1)
            last = torch.where(found == 0, width - 1, width - 1 - from_end)
            return (hidden * weights)[_rows(hidden), last]
        if mode is PoolingMode.MAX:
            filled = hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
            # An input with no pooled token gives zeros, not -inf (which JSON cannot carry).
            return torch.where(weights.sum(dim=1) > 0, filled, torch.zeros_like(filled))
        summed = (hidden * weights).sum(dim=1)
        if mode is PoolingMode.MEAN:
            return summed / count
        if mode is PoolingMode.MEAN_SQRT_LEN:
            return summed / count.sqrt()
        # WEIGHTED_MEAN: position t (from 1) weighs t; an excluded prompt keeps its positions.
        position = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=torch.float32)
        weighted = weights * position.view(1, -1, 1)
        return (hidden * weighted).sum(dim=1) / weighted.sum(dim=1).clamp(min=1e-9)


def _rows(hidden: Tensor) -> Tensor:
    """Each input's row index, to pick one token per input."""
    return torch.arange(hidden.shape[0], device=hidden.device)


# Dense activations, by the class name sentence-transformers writes (`torch.nn....Tanh`).
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "Tanh": nn.Tanh,
    "Identity": nn.Identity,
    "ReLU": nn.ReLU,
    "GELU": nn.GELU,
    "Sigmoid": nn.Sigmoid,
    "SiLU": nn.SiLU,
}


@dataclass(frozen=True)
class DenseSpec:
    """One sentence-transformers Dense module's `config.json`."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "Tanh"
    use_residual: bool = False


class Dense(nn.Module):
    """sentence-transformers' Dense: activation(linear(x)), plus x (or a projection) if residual.

    Attribute names are those of its weights file (`linear.weight`, `residual.weight`).
    """

    def __init__(self, spec: DenseSpec) -> None:
        super().__init__()
        self.spec = spec
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = ACTIVATIONS[spec.activation]()
        if spec.use_residual and spec.in_features != spec.out_features:
            self.residual = nn.Linear(spec.in_features, spec.out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.activation(self.linear(x))
        if self.spec.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


class Normalize(nn.Module):
    """A Normalize module in the middle of the pipeline (a trailing one is the `normalize` flag)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, p=2, dim=-1)


class EmbeddingPipeline(nn.Module):
    """Pooling, then the Dense and Normalize modules in the folder's order, then the first
    `truncate_dim` features kept (sentence-transformers cuts there too, after the modules).

    A Normalize at the very end is not run here but reported as `normalize`: the request's
    own `normalize` (default true, as in text-embeddings-inference) decides, after the cuts.
    So a model with a truncate_dim and a final Normalize serves its cut vectors normalised,
    as sentence-transformers' `encode(normalize_embeddings=True)` does (without it,
    sentence-transformers returns the cut piece of a unit vector: the same direction, a
    shorter length).
    """

    def __init__(
        self,
        pooling: Pooling,
        steps: Sequence[nn.Module],
        normalize: bool,
        truncate_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.pooling = pooling
        self.steps = nn.ModuleList(steps)
        self.normalize = normalize
        self.truncate_dim = truncate_dim

    def forward(self, hidden: Tensor, attention_mask: Tensor, prompt_lengths: Tensor) -> Tensor:
        """(B, T, D) states -> (B, dimensions) float32 vectors, before the request's cut and
        the norm."""
        vectors = self.pooling(hidden, attention_mask, prompt_lengths)
        for step in self.steps:
            vectors = step(vectors)
        return vectors[:, : self.truncate_dim]

    def dimensions(self, hidden_size: int) -> int:
        """Size of the vectors this pipeline gives for an encoder of `hidden_size`."""
        size = hidden_size * len(self.pooling.modes)
        for step in self.steps:
            if isinstance(step, Dense):
                size = step.spec.out_features
        return min(size, self.truncate_dim or size)
