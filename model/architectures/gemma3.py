"""Gemma 3's text model with bidirectional attention (EmbeddingGemma).

Pre- and post-norm blocks: each sub-layer's input and output go through Gemma's RMSNorm
(x * (1 + w), in float32), queries and keys through one more per head. Attention groups query
heads over fewer key/value heads, scales scores by `query_pre_attn_scalar`, and turns queries
and keys by rotary positions: full layers with base `rope_theta`, sliding ones with
`rope_local_base_freq` and a window of `sliding_window // 2` tokens on each side (how
transformers shapes a bidirectional model's window). The feed-forward is GeGLU. Attribute
names follow Gemma3TextModel's checkpoint keys (`layers.0.self_attn.q_proj.weight`, ...), so
weights load without a renaming table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from model.activations import ACTIVATIONS, Activation, activate
from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.architectures.modernbert import global_layers, rope_theta
from model.attention import NO_MAPS, MapRequest, Mask, attend, sliding_window
from model.errors import ConfigError
from model.packing import TokenLayout, in_row_chunks
from model.rotary import rotary_tables, rotate


@dataclass(frozen=True, kw_only=True)
class Gemma3Config(EncoderConfig):
    # Gemma3ForCausalLM keeps the text model under `model.`.
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("model.",)

    # Explicit in Gemma's config, not hidden_size / num_attention_heads (EmbeddingGemma: 256
    # with hidden_size 768 and 3 heads); this field shadows the base class's derived one.
    head_dim: int = 256
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    # One per layer: True where it attends to the whole sequence, False where to its window.
    full_layers: tuple[bool, ...]
    hidden_activation: Activation = "gelu_tanh"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256.0
    # Tokens a sliding layer sees on each side of a query.
    local_window: int = 2048
    full_rope_theta: float = 1_000_000.0
    sliding_rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ConfigError("rotary positions need an even head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.query_pre_attn_scalar <= 0:
            raise ConfigError(
                f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}"
            )

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def positions(self) -> str:
        return "rotary"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> Gemma3Config:
        # Causal Gemma 3 (a generative model) is not an encoder this service runs.
        config.expect("use_bidirectional_attention", True, False)
        config.expect("attn_logit_softcapping", None, None)
        config.expect("rope_scaling", None, None)  # would change the rotary scheme
        # `final_logit_softcapping` and `tie_word_embeddings` shape the language-model head
        # only, and `attention_dropout` training only: none changes the hidden states.
        num_layers = config.positive_int("num_hidden_layers")
        return cls(
            model_type="gemma3_text",
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("hidden_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=config.positive_int("num_attention_heads"),
            pad_token_id=config.integer("pad_token_id", 0),
            head_dim=config.positive_int("head_dim", 256),
            num_key_value_heads=config.positive_int("num_key_value_heads", 4),
            intermediate_size=config.positive_int("intermediate_size"),
            max_position_embeddings=config.positive_int("max_position_embeddings", 131_072),
            full_layers=full_layers(config, num_layers),
            hidden_activation=config.choice("hidden_activation", ACTIVATIONS, "gelu_pytorch_tanh"),
            rms_norm_eps=config.number("rms_norm_eps", 1e-6),
            attention_bias=config.flag("attention_bias", False),
            query_pre_attn_scalar=config.number("query_pre_attn_scalar", 256),
            # transformers keeps tokens closer than `sliding_window // 2 + 1` on either side.
            local_window=config.positive_int("sliding_window", 4096) // 2,
            full_rope_theta=rope_theta(config, "full_attention", "rope_theta", 1_000_000.0),
            sliding_rope_theta=rope_theta(
                config, "sliding_attention", "rope_local_base_freq", 10_000.0
            ),
        )

    def build(self) -> Gemma3Encoder:
        return Gemma3Encoder(self)


def full_layers(config: ConfigReader, num_layers: int) -> tuple[bool, ...]:
    """From `layer_types`; older configs give `sliding_window_pattern` instead, and every
    pattern-th layer (counting from 1) attends to the full sequence."""
    if config.raw.get("layer_types") is None:
        pattern = config.positive_int("sliding_window_pattern", 6)
        return tuple((index + 1) % pattern == 0 for index in range(num_layers))
    return global_layers(config, num_layers)


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1, and the product is taken in float32
    before rounding to the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype first
    as transformers rounds it (sqrt(768) becomes 27.75 in bfloat16)."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__(config.vocab_size, config.hidden_size)
        self.scale = config.hidden_size**0.5

    def forward(self, input_ids: Tensor) -> Tensor:
        x = super().forward(input_ids)
        return x * torch.tensor(self.scale).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention: per-head RMSNorm on queries and keys, then rotary."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        size, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        h: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        allowed: Mask,
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) projected context, and (B, h, T, T) if asked."""
        q = layout.heads(self.per_head_norm(self.q_proj(h), self.q_norm), self.num_heads)
        k = layout.heads(self.per_head_norm(self.k_proj(h), self.k_norm), self.num_kv_heads)
        v = layout.heads(self.v_proj(h), self.num_kv_heads)  # (B, Hkv, T, hd)
        q, k = rotate(q, *rotary), rotate(k, *rotary)  # (B, H, T, hd), (B, Hkv, T, hd)
        # Query head i reads key/value head i // group, as transformers' `repeat_kv` lays out.
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        context, probs = attend(q, k, v, allowed, scale=self.scale, map_heads=map_heads)
        out: Tensor = self.o_proj(layout.merge_heads(context))
        return out, probs

    def per_head_norm(self, x: Tensor, norm: RMSNorm) -> Tensor:
        """(N, heads x hd) -> the same, each head's slice normalised on its own."""
        out: Tensor = norm(x.view(*x.shape[:-1], -1, self.head_dim)).flatten(-2)
        return out


class MLP(nn.Module):
    """GeGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(size, inner, bias=False)
        self.up_proj = nn.Linear(size, inner, bias=False)
        self.down_proj = nn.Linear(inner, size, bias=False)
        self.activation = config.hidden_activation

    def forward(self, x: Tensor) -> Tensor:
        gated = activate(self.gate_proj(x), self.activation) * self.up_proj(x)
        out: Tensor = self.down_proj(gated)
        return out


class DecoderLayer(nn.Module):
    """Attention and MLP, each between a norm on its input and one on its output, each added
    to the residual stream."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(
        self,
        x: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        allowed: Mask,
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.self_attn(self.input_layernorm(x), layout, rotary, allowed, map_heads)
        x = x + self.post_attention_layernorm(context)
        return in_row_chunks(self.feed_forward, x), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(x))
        )
        return out


class Gemma3Encoder(Encoder):
    """Scaled embeddings, the layers, a final norm; Gemma has no token types, so any are
    ignored."""

    config: Gemma3Config

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = ScaledEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        x = self.embed_tokens(input_ids)  # (B, T, D)
        width = input_ids.shape[1]
        config, device = self.config, input_ids.device
        window = sliding_window(width, config.local_window, device)  # (T, T)
        # Keyed by whether a layer attends fully: its rotary tables and the keys it may see.
        rotary = {
            full: rotary_tables(theta, config.head_dim, width, device, x.dtype)
            for full, theta in ((True, config.full_rope_theta), (False, config.sliding_rope_theta))
        }
        allowed = {True: layout.key_mask, False: layout.key_mask.narrowed(window)}  # (B, 1, 1|T, T)
        h = layout.pack(x)  # (N, D)
        full = config.full_layers
        h, kept = run_layers(
            self.layers, h, layout, maps, lambda i: (rotary[full[i]], allowed[full[i]])
        )
        return EncoderOutput(layout.unpack(self.norm(h)), kept)
