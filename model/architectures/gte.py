"""GTE v1.5 and mGTE (Alibaba's `new` model type; Snowflake's arctic-embed-m-v2.0 as `gte`).

A post-norm encoder like BERT, with rotary positions (optionally NTK-scaled) instead of learned
ones, q, k and v from one projection, and a gated feed-forward. Its modelling code lives only
with the weights (Alibaba-NLP/new-impl, loaded through `auto_map`); attribute names follow
that code's checkpoint keys (`encoder.layer.0.attention.qkv_proj.weight`, ...), so weights
load without a renaming table.

config.json keys: `unpad_inputs` and `use_memory_efficient_attention` choose how the reference
runs (unpadded tokens, xformers) and give the same numbers, so any value is accepted;
`logn_attention_clip1` only acts with `logn_attention_scale`, which is refused. Dropout rates
and `initializer_range` are for training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from model.activations import ACTIVATIONS, Activation, activate
from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, attend
from model.errors import ConfigError
from model.packing import TokenLayout, in_row_chunks
from model.rotary import rotary_tables, rotate

NormKind = Literal["layer_norm", "rms_norm"]
NORMS: dict[str, NormKind] = {"layer_norm": "layer_norm", "rms_norm": "rms_norm"}
# `rope_scaling` keys the reference reads; `mixed_b` selects its mixed NTK variant.
ROPE_SCALING_KEYS = ("type", "factor", "mixed_b")


@dataclass(frozen=True, kw_only=True)
class GteConfig(EncoderConfig):
    # The reference's task models (NewForMaskedLM, ...) keep the encoder under `new.`.
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("new.",)

    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 1
    hidden_act: Activation = "gelu"
    layer_norm_eps: float = 1e-12
    # The norm after each sub-layer; the embeddings' norm is a LayerNorm either way.
    layer_norm_type: NormKind = "layer_norm"
    rope_theta: float = 10_000.0
    # `rope_scaling.factor` of NTK scaling; 1.0 leaves the rotary frequencies as they are.
    ntk_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ConfigError("rotary positions need an even head dimension")

    @property
    def max_positions(self) -> int:
        # Rotary positions have no table to run out of; the models were trained up to here.
        return self.max_position_embeddings

    @property
    def positions(self) -> str:
        return "rotary (NTK-scaled)" if self.ntk_factor != 1.0 else "rotary"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> GteConfig:
        # Defaults are the reference's NewConfig defaults.
        config.expect("position_embedding_type", "rope", "rope")
        # Separate q, k and v projections would be other checkpoint keys (q_proj, ...).
        config.expect("pack_qkv", True, True)
        # Scales queries by the log of the input length; the reference's later revision
        # ignores the key, so which behaviour a checkpoint expects is not known.
        config.expect("logn_attention_scale", False, False)
        type_vocab_size = config.integer("type_vocab_size", 1)
        if type_vocab_size < 0:
            raise config.error(f"key 'type_vocab_size' must not be negative, got {type_vocab_size}")
        return cls(
            model_type=str(config.raw["model_type"]),
            vocab_size=config.positive_int("vocab_size", 30528),
            hidden_size=config.positive_int("hidden_size", 768),
            num_hidden_layers=config.positive_int("num_hidden_layers", 12),
            num_attention_heads=config.positive_int("num_attention_heads", 12),
            pad_token_id=config.integer("pad_token_id", 0),
            type_vocab_size=type_vocab_size,
            intermediate_size=config.positive_int("intermediate_size", 3072),
            max_position_embeddings=config.positive_int("max_position_embeddings", 2048),
            hidden_act=config.choice("hidden_act", ACTIVATIONS, "gelu"),
            layer_norm_eps=config.number("layer_norm_eps", 1e-12),
            layer_norm_type=config.choice("layer_norm_type", NORMS, "layer_norm"),
            rope_theta=config.number("rope_theta", 10_000.0),
            ntk_factor=ntk_factor(config),
        )

    def build(self) -> GteEncoder:
        return GteEncoder(self)


def ntk_factor(config: ConfigReader) -> float:
    """`rope_scaling`: absent (or null) for plain rotary positions, else fixed NTK scaling."""
    scaling = config.raw.get("rope_scaling")
    if scaling is None:
        return 1.0
    if not isinstance(scaling, dict):
        raise config.error("key 'rope_scaling' must be an object or null")
    unknown = sorted(set(scaling) - set(ROPE_SCALING_KEYS))
    if unknown:
        raise config.error(f"unsupported rope_scaling key {unknown[0]!r}")
    nested = ConfigReader(scaling, f"{config.source}: rope_scaling")
    nested.expect("type", "ntk", None)
    nested.expect("mixed_b", None, None)
    if "factor" not in scaling:
        raise nested.error("missing key 'factor'")
    factor = nested.number("factor", 1.0)
    if factor < 1.0:
        # Below 1 the reference switches its frequencies once an input outgrows
        # max_position_embeddings, and keeps them for every later input.
        raise nested.error(f"key 'factor' must be at least 1, got {factor!r}")
    return factor


def ntk_rotary_tables(
    config: GteConfig, width: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(T, hd) cos and sin for positions 0..T-1, as the reference's NTK scaling computes them:
    the base multiplied by the factor, and every frequency divided by factor^(2 / hd). The
    reference applies this at every input length, short ones included."""
    head_dim, factor = config.head_dim, config.ntk_factor
    exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
    inverse = 1.0 / ((config.rope_theta * factor) ** exponents) / factor ** (2 / head_dim)
    position = torch.arange(width, device=device, dtype=torch.float)
    angles = position[:, None] * inverse[None, :]  # (T, hd / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def sublayer_norm(config: GteConfig) -> nn.Module:
    if config.layer_norm_type == "rms_norm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class Embeddings(nn.Module):
    """Token (+ token type) embeddings, then LayerNorm; positions enter inside attention."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        # One type: every token is type 0 (the reference's later revision zeroes any ids it
        # is given); several: the ids given, type 0 where none are.
        self.type_ids_used = config.type_vocab_size > 1
        if config.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x: Tensor = self.word_embeddings(input_ids)  # (B, T, D)
        if hasattr(self, "token_type_embeddings"):
            if self.type_ids_used and token_type_ids is not None:
                x = x + self.token_type_embeddings(token_type_ids)
            else:
                x = x + self.token_type_embeddings.weight[0]
        out: Tensor = self.LayerNorm(x)
        return out


class Attention(nn.Module):
    """Self-attention with rotary queries and keys; q, k and v come from one projection."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.qkv_proj = nn.Linear(size, 3 * size)
        self.o_proj = nn.Linear(size, size)

    def forward(
        self,
        h: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) projected context, and (B, h, T, T) if asked."""
        # qkv_proj's rows are q's heads, then k's, then v's.
        q, k, v = layout.heads(self.qkv_proj(h), 3 * self.num_heads).chunk(3, dim=1)
        q, k = rotate(q, *rotary), rotate(k, *rotary)  # (B, H, T, hd)
        context, probs = attend(q, k, v, layout.key_mask, map_heads=map_heads)
        out: Tensor = self.o_proj(layout.merge_heads(context))
        return out, probs


class GatedMLP(nn.Module):
    """up_gate_proj's first half times its second half activated; then down_proj."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.up_gate_proj = nn.Linear(size, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, size)
        self.activation = config.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        up, gate = self.up_gate_proj(x).chunk(2, dim=-1)
        out: Tensor = self.down_proj(up * activate(gate, self.activation))
        return out


class Layer(nn.Module):
    """Attention, then the gated feed-forward, each added to its input and then normed."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.attn_ln = sublayer_norm(config)
        self.mlp = GatedMLP(config)
        self.mlp_ln = sublayer_norm(config)

    def forward(
        self,
        x: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.attention(x, layout, rotary, map_heads)
        return in_row_chunks(self.feed_forward, self.attn_ln(x + context)), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.mlp_ln(x + self.mlp(x))
        return out


class Stack(nn.Module):
    """The layers, under the checkpoint's `encoder.layer.N` names."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))


class GteEncoder(Encoder):
    """Embeddings and the post-norm layers; no norm after the stack."""

    config: GteConfig

    def __init__(self, config: GteConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Stack(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, D)
        rotary = self.rotary_tables(input_ids.shape[1], input_ids.device, x.dtype)
        h = layout.pack(x)  # (N, D)
        h, kept = run_layers(self.encoder.layer, h, layout, maps, lambda index: (rotary,))
        return EncoderOutput(layout.unpack(h), kept)

    def rotary_tables(
        self, width: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        config = self.config
        if config.ntk_factor == 1.0:
            return rotary_tables(config.rope_theta, config.head_dim, width, device, dtype)
        return ntk_rotary_tables(config, width, device, dtype)
