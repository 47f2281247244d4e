"""What every architecture provides: a frozen config read from `config.json`, and a network.

Each architecture module (bert.py, distilbert.py, ...) defines one config dataclass, derived
from `EncoderConfig`, and one `Encoder`. Module attribute names follow the checkpoint keys of
the reference implementation, so weights load without a renaming table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

from model.attention import MapRequest
from model.errors import ConfigError
from model.packing import TokenLayout

T = TypeVar("T")


class ConfigReader:
    """Reads keys from a `config.json`; a missing key or a bad value is named with the file."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key, default)
        if value is None:
            raise self.error(f"missing key {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(f"key {key!r} must be a positive integer, got {value!r}")
        return value

    def integer(self, key: str, default: int) -> int:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"key {key!r} must be an integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(f"key {key!r} must be a number, got {value!r}")
        return float(value)

    def choice(self, key: str, options: Mapping[Any, T], default: Any) -> T:
        """A value that must be one of `options`' keys, mapped to what this code calls it."""
        return self.choice_of(key, self.raw.get(key, default), options)

    def layer_types(self, num_layers: int, supported: Mapping[str, T]) -> tuple[T, ...] | None:
        """`layer_types` (transformers 5 configs), one supported entry per layer, mapped to
        what this code calls it; None where the config predates the key."""
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.error(
                f"key 'layer_types' must list one type for each of {num_layers} layers"
            )
        return tuple(self.choice_of("layer_types entry", kind, supported) for kind in types)

    def choice_of(self, name: str, value: Any, options: Mapping[Any, T]) -> T:
        if value not in options:
            raise self.error(
                f"unsupported {name} {value!r} (supported: {', '.join(map(str, options))})"
            )
        return options[value]

    def flag(self, key: str, default: bool) -> bool:
        """A switch that takes JSON booleans only (not 0, 1 or "true")."""
        return self.choice(key, {False: False, True: True}, default)

    def expect(self, key: str, supported: Any, default: Any) -> None:
        """A key this code implements for one value only; any other value is refused."""
        value = self.raw.get(key, default)
        if value != supported:
            raise self.error(f"unsupported {key} {value!r} (only {supported!r} is implemented)")


@dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """The fields every architecture has; the service reads nothing else."""

    # Checkpoint key prefixes of task models built on this encoder (`bert.` in
    # BertForMaskedLM, ...), tried when the bare keys are not in the weights file.
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    pad_token_id: int = 0
    # Token types (segments) the embeddings know; 0 when the model has none.
    type_vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """How many tokens the position scheme can number."""
        raise NotImplementedError

    @property
    def positions(self) -> str:
        """The position scheme, as /info names it: `learned`, `rotary`, `alibi`, ..."""
        raise NotImplementedError

    @classmethod
    def from_hf(cls, config: ConfigReader) -> EncoderConfig:
        """Build from a Hugging Face `config.json`."""
        raise NotImplementedError

    def build(self) -> Encoder:
        """The network, with uninitialised weights (call under `torch.device('meta')`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class EncoderOutput:
    hidden: Tensor  # (B, T, D) last hidden states; padded positions hold no meaningful values
    maps: dict[int, Tensor]  # layer -> (B, h, T, T) probabilities of the heads asked for


class Encoder(nn.Module):
    """A stack of self-attention blocks over token ids; what every architecture implements."""

    config: EncoderConfig

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        """(B, T) ids and 1/0 mask (right-padded), optional (B, T) token types."""
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Recompute buffers that are not in the checkpoint (built on the meta device)."""


def run_layers(
    layers: Iterable[nn.Module],
    h: Tensor,
    layout: TokenLayout,
    maps: MapRequest,
    context: Callable[[int], tuple[Any, ...]] = lambda index: (),
) -> tuple[Tensor, dict[int, Tensor]]:
    """(N, D) packed tokens through each layer in turn, called as
    `layer(h, layout, *context(index), map_heads)` (what else layer `index` needs: rotary
    tables, a position bias, its attention mask); also the (B, h, T, T) probabilities of the
    layers whose maps were asked for, by layer."""
    kept: dict[int, Tensor] = {}
    for index, layer in enumerate(layers):
        h, probs = layer(h, layout, *context(index), maps.heads if maps.wants(index) else None)
        if probs is not None:
            kept[index] = probs
    return h, kept
