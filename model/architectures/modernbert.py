"""ModernBERT: pre-norm blocks with rotary positions, gated GELU, and local attention layers.

Every `global_attn_every_n_layers`-th layer (from the first) attends to the whole sequence with
rotary base `global_rope_theta`; the others attend to the `local_attention // 2` tokens on each
side with base `local_rope_theta`. Attribute names follow the Hugging Face checkpoint keys
(`layers.0.attn.Wqkv.weight`, ...), so weights load without a renaming table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from model.activations import ACTIVATIONS, Activation, activate
from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, Mask, attend, sliding_window
from model.errors import ConfigError
from model.packing import TokenLayout, in_row_chunks
from model.rotary import rotary_tables, rotate

# `layer_types` entries (transformers 5 configs): True for a global layer.
LAYER_TYPES = {"full_attention": True, "sliding_attention": False}


@dataclass(frozen=True, kw_only=True)
class ModernBertConfig(EncoderConfig):
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("model.",)

    intermediate_size: int
    max_position_embeddings: int
    # One per layer: True where it attends globally, False where it attends locally.
    global_layers: tuple[bool, ...]
    hidden_activation: Activation = "gelu"
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Tokens a local layer sees on each side of a query.
    local_window: int = 64
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ConfigError("rotary positions need an even head dimension")

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def positions(self) -> str:
        return "rotary"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> ModernBertConfig:
        num_layers = config.positive_int("num_hidden_layers")
        config.expect("rope_scaling", None, None)  # would change the rotary scheme
        return cls(
            model_type="modernbert",
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("hidden_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=config.positive_int("num_attention_heads"),
            pad_token_id=config.integer("pad_token_id", 50283),
            intermediate_size=config.positive_int("intermediate_size"),
            max_position_embeddings=config.positive_int("max_position_embeddings", 8192),
            global_layers=global_layers(config, num_layers),
            hidden_activation=config.choice("hidden_activation", ACTIVATIONS, "gelu"),
            norm_eps=config.number("norm_eps", 1e-5),
            norm_bias=config.flag("norm_bias", False),
            attention_bias=config.flag("attention_bias", False),
            mlp_bias=config.flag("mlp_bias", False),
            local_window=config.positive_int("local_attention", 128) // 2,
            global_rope_theta=rope_theta(config, "full_attention", "global_rope_theta", 160_000.0),
            local_rope_theta=rope_theta(config, "sliding_attention", "local_rope_theta", 10_000.0),
        )

    def build(self) -> ModernBertEncoder:
        return ModernBertEncoder(self)


def global_layers(config: ConfigReader, num_layers: int) -> tuple[bool, ...]:
    """From `layer_types` (transformers 5), else from `global_attn_every_n_layers` (older)."""
    types = config.layer_types(num_layers, LAYER_TYPES)
    if types is None:
        every = config.positive_int("global_attn_every_n_layers", 3)
        return tuple(index % every == 0 for index in range(num_layers))
    return types


def rope_theta(config: ConfigReader, layer_type: str, flat_key: str, default: float) -> float:
    """A layer type's rotary base, from `rope_parameters` (transformers 5) or, as transformers
    falls back, from the older flat key. Only plain rotary positions are implemented."""
    parameters = config.raw.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise config.error("key 'rope_parameters' must be an object")
    entry = parameters.get(layer_type) or {}
    if not isinstance(entry, dict):
        raise config.error(f"key 'rope_parameters.{layer_type}' must be an object")
    nested = ConfigReader(entry, f"{config.source}: rope_parameters.{layer_type}")
    nested.expect("rope_type", "default", "default")
    return nested.number("rope_theta", config.number(flat_key, default))


class Embeddings(nn.Module):
    """Token embeddings, then LayerNorm; positions enter inside attention."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = layer_norm(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.norm(self.tok_embeddings(input_ids))
        return out


def layer_norm(config: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class Attention(nn.Module):
    """Self-attention with rotary queries and keys; q, k and v come from one projection."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.Wqkv = nn.Linear(size, 3 * size, bias=config.attention_bias)
        self.Wo = nn.Linear(size, size, bias=config.attention_bias)

    def forward(
        self,
        h: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        allowed: Mask,
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) projected context, and (B, h, T, T) if asked."""
        # Wqkv's rows are q's heads, then k's, then v's.
        q, k, v = layout.heads(self.Wqkv(h), 3 * self.num_heads).chunk(3, dim=1)  # (B, H, T, hd)
        q, k = rotate(q, *rotary), rotate(k, *rotary)
        context, probs = attend(q, k, v, allowed, map_heads=map_heads)
        out: Tensor = self.Wo(layout.merge_heads(context))
        return out, probs


class MLP(nn.Module):
    """Gated feed-forward: Wi's first half, activated, times its second half; then Wo."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.Wi = nn.Linear(size, 2 * inner, bias=config.mlp_bias)
        self.Wo = nn.Linear(inner, size, bias=config.mlp_bias)
        self.activation = config.hidden_activation

    def forward(self, x: Tensor) -> Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        out: Tensor = self.Wo(activate(value, self.activation) * gate)
        return out


class EncoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: ModernBertConfig, index: int) -> None:
        super().__init__()
        # The first layer reads the embedding norm's output, so it has no norm of its own.
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else layer_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = layer_norm(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        allowed: Mask,
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.attn(self.attn_norm(x), layout, rotary, allowed, map_heads)
        return in_row_chunks(self.feed_forward, x + context), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class ModernBertEncoder(Encoder):
    """Embeddings, the layers, a final norm; ModernBERT has no token types, so any are ignored."""

    config: ModernBertConfig

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(
            EncoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.final_norm = layer_norm(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        x = self.embeddings(input_ids)  # (B, T, D)
        width = input_ids.shape[1]
        config, device = self.config, input_ids.device
        window = sliding_window(width, config.local_window, device)  # (T, T)
        # Keyed by whether a layer is global: its rotary tables and the keys it may attend to.
        rotary = {
            True: rotary_tables(config.global_rope_theta, config.head_dim, width, device, x.dtype),
            False: rotary_tables(config.local_rope_theta, config.head_dim, width, device, x.dtype),
        }
        allowed = {True: layout.key_mask, False: layout.key_mask.narrowed(window)}  # (B, 1, 1|T, T)
        h = layout.pack(x)  # (N, D)
        is_global = config.global_layers
        h, kept = run_layers(
            self.layers, h, layout, maps, lambda i: (rotary[is_global[i]], allowed[is_global[i]])
        )
        return EncoderOutput(layout.unpack(self.final_norm(h)), kept)
