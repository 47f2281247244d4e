"""NomicBERT (nomic-embed-text-v1 and v1.5): post-norm blocks with rotary positions on some or
all of each head's features, q, k and v from one projection, and a gated feed-forward.

Its modelling code lives only with the weights (nomic-ai/nomic-bert-2048, loaded through
`auto_map`; the same file is in nomic-ai/contrastors). Its config is GPT-2's, so keys are spelt
`n_embd`, `n_layer`, ... and take GPT-2's defaults where absent. Attribute names follow that
code's checkpoint keys (`emb_ln.weight`, `encoder.layers.0.attn.Wqkv.weight`, ...), so weights
load without a renaming table.

With `rotary_scaling_factor` set, an input longer than `max_trained_positions` turns its queries
and keys with a rotary base stretched for its length (dynamic NTK). The authors' code stretches
it for the width of the padded batch and keeps the stretched tables for later calls; here each
input gets the base the authors' code gives it when it runs alone, so a batch changes nothing.

config.json keys not read: dropout rates other than `attn_pdrop` (off in inference), kernel
switches (`use_flash_attn`, `fused_bias_fc`, `fused_dropout_add_ln`, `use_xentropy`), training
settings (`dense_seq_output`, `initializer_range`), GPT-2 keys the authors' code never reads
(`summary_*`, `scale_attn_weights`, ...), and `parallel_block_tied_norm`, which acts only with
the refused `parallel_block`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, attend
from model.errors import ConfigError
from model.packing import TokenLayout, in_row_chunks
from model.rotary import rotary_tables, rotate

FeedForward = Literal["swiglu", "glu", "geglu", "gelu"]
# `activation_function` spellings the authors' code accepts. Its plain feed-forward applies
# exact GELU whichever GELU it is given.
FEED_FORWARDS: dict[str, FeedForward] = {
    "swiglu": "swiglu",
    "glu": "glu",
    "geglu": "geglu",
    "gelu": "gelu",
    "gelu_new": "gelu",
    "gelu_fast": "gelu",
    "gelu_pytorch_tanh": "gelu",
}
# What each gated feed-forward applies to `fc12`'s output before multiplying `fc11`'s by it.
GATES: dict[FeedForward, Callable[[Tensor], Tensor]] = {
    "swiglu": F.silu,
    "glu": torch.sigmoid,
    "geglu": F.gelu,
}
# The authors' gated feed-forward rounds its width up to a multiple of this.
GATED_WIDTH_MULTIPLE = 256
# Keys of the authors' code that would change the network, at the one value implemented here
# (their default).
ONLY_DEFAULTS = {
    "prenorm": False,
    "causal": False,
    "parallel_block": False,
    "use_rms_norm": False,
    "norm_mlp": False,
    "moe_every_n_layers": 0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_head_dim": False,
}


@dataclass(frozen=True, kw_only=True)
class NomicBertConfig(EncoderConfig):
    # NomicBertForPreTraining and the classifiers keep the encoder under `bert.`.
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("bert.",)

    intermediate_size: int  # the feed-forward's width in the weights (rounded up when gated)
    n_positions: int
    feed_forward: FeedForward = "swiglu"
    layer_norm_epsilon: float = 1e-5
    type_vocab_size: int = 2
    # Share of each head's features that rotary positions turn (the leading ones).
    rotary_emb_fraction: float = 1.0
    rotary_emb_base: float = 10_000.0
    # None: the same rotary base at every length.
    rotary_scaling_factor: float | None = None
    max_trained_positions: int = 2048
    qkv_proj_bias: bool = True
    mlp_fc1_bias: bool = True
    mlp_fc2_bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        turned = self.head_dim * self.rotary_emb_fraction
        if turned <= 0:
            raise ConfigError(
                f"rotary_emb_fraction {self.rotary_emb_fraction}: positions without rotary "
                "(learned position embeddings) are not implemented"
            )
        if turned != int(turned) or int(turned) % 2 or turned > self.head_dim:
            raise ConfigError(
                f"rotary_emb_fraction {self.rotary_emb_fraction} of a {self.head_dim}-feature "
                "head must turn an even number of its features"
            )
        if self.rotary_scaling_factor is not None and self.rotary_dim <= 2:
            raise ConfigError("rotary_scaling_factor needs more than 2 rotary features per head")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_emb_fraction)

    @property
    def max_positions(self) -> int:
        # Rotary positions have no table to run out of; the models publish this as their length.
        return self.n_positions

    @property
    def positions(self) -> str:
        return "rotary"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> NomicBertConfig:
        for key, value in ONLY_DEFAULTS.items():
            config.expect(key, value, value)
        # GPT-2's 0.1 when absent; the authors' code passes it to scaled_dot_product_attention
        # as `dropout_p`, which drops attention weights in inference too.
        config.expect("attn_pdrop", 0.0, 0.1)
        hidden = config.positive_int("n_embd", 768)
        heads = config.positive_int("n_head", 12)
        if config.raw.get("num_heads_kv") is not None:
            config.expect("num_heads_kv", heads, heads)  # fewer key/value heads: not implemented
        feed_forward = config.choice("activation_function", FEED_FORWARDS, "gelu_new")
        type_vocab_size = config.integer("type_vocab_size", 2)
        if type_vocab_size < 0:
            raise config.error(f"key 'type_vocab_size' must be 0 or more, got {type_vocab_size}")
        return cls(
            model_type="nomic_bert",
            vocab_size=padded_vocab_size(config),
            hidden_size=hidden,
            num_hidden_layers=config.positive_int("n_layer", 12),
            num_attention_heads=heads,
            pad_token_id=config.integer("pad_token_id", 0),
            type_vocab_size=type_vocab_size,
            intermediate_size=feed_forward_width(config, feed_forward, hidden),
            # GPT-2's config reads `max_position_embeddings` as another name for `n_positions`.
            n_positions=config.positive_int(
                "n_positions", config.raw.get("max_position_embeddings", 1024)
            ),
            feed_forward=feed_forward,
            layer_norm_epsilon=config.number("layer_norm_epsilon", 1e-5),
            rotary_emb_fraction=config.number("rotary_emb_fraction", 0.0),
            rotary_emb_base=config.number("rotary_emb_base", 10_000.0),
            rotary_scaling_factor=scaling_factor(config),
            max_trained_positions=config.positive_int("max_trained_positions", 2048),
            qkv_proj_bias=config.flag("qkv_proj_bias", True),
            mlp_fc1_bias=config.flag("mlp_fc1_bias", True),
            mlp_fc2_bias=config.flag("mlp_fc2_bias", True),
        )

    def build(self) -> NomicBertEncoder:
        return NomicBertEncoder(self)


def padded_vocab_size(config: ConfigReader) -> int:
    """The authors' code grows the vocabulary to a multiple of `pad_vocab_size_multiple`."""
    size = config.positive_int("vocab_size", 50257)
    multiple = config.positive_int("pad_vocab_size_multiple", 1)
    return -(-size // multiple) * multiple


def feed_forward_width(config: ConfigReader, feed_forward: FeedForward, hidden: int) -> int:
    """`n_inner`, or the authors' default when it is absent or null; gated widths rounded up."""
    gated = feed_forward != "gelu"
    width = int(8 * hidden / 3) if gated else 4 * hidden
    if config.raw.get("n_inner") is not None:
        width = config.positive_int("n_inner")
    return -(-width // GATED_WIDTH_MULTIPLE) * GATED_WIDTH_MULTIPLE if gated else width


def scaling_factor(config: ConfigReader) -> float | None:
    """`rotary_scaling_factor`; the authors' code scales only when it is set and not 0."""
    if config.raw.get("rotary_scaling_factor") is None:
        return None
    factor = config.number("rotary_scaling_factor", 0.0)
    if factor < 0:
        raise config.error(f"key 'rotary_scaling_factor' must not be negative, got {factor}")
    return factor or None


def stretched_rotary_tables(
    config: NomicBertConfig, factor: float, attention_mask: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(B, 1, T, rd) cos and sin, each row's from its own length: rows longer than
    `max_trained_positions` turn with the dynamic-NTK base for `factor` and their length, the
    others with `rotary_emb_base`. Computed on the device, so that nothing waits for the mask."""
    device, dims, trained = attention_mask.device, config.rotary_dim, config.max_trained_positions
    # The authors' code computes the stretched base in double precision.
    lengths = attention_mask.sum(dim=1, dtype=torch.float64)  # (B,)
    base = torch.full_like(lengths, config.rotary_emb_base)
    stretch = (factor * lengths / trained - (factor - 1)) ** (dims / (dims - 2))
    base = torch.where(lengths > trained, base * stretch, base).float()
    exponents = torch.arange(0, dims, 2, device=device).float() / dims
    inverse = 1.0 / (base[:, None] ** exponents)  # (B, rd / 2)
    position = torch.arange(attention_mask.shape[1], device=device, dtype=torch.float)
    angles = position[None, :, None] * inverse[:, None, :]  # (B, T, rd / 2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, rd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_leading(x: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
    """(B, H, T, hd) queries or keys with their first rd features turned (rd from the tables)."""
    dims = rotary[0].shape[-1]
    if dims == x.shape[-1]:
        return rotate(x, *rotary)
    return torch.cat((rotate(x[..., :dims], *rotary), x[..., dims:]), dim=-1)


class Embeddings(nn.Module):
    """Token (+ token type) embeddings; the LayerNorm after them is the encoder's `emb_ln`."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x: Tensor = self.word_embeddings(input_ids)  # (B, T, D)
        if not hasattr(self, "token_type_embeddings"):
            return x
        if token_type_ids is None:  # one segment: every token has type 0
            return x + self.token_type_embeddings.weight[0]
        out: Tensor = x + self.token_type_embeddings(token_type_ids)
        return out


class Attention(nn.Module):
    """Self-attention with rotary queries and keys; q, k and v come from one projection."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.Wqkv = nn.Linear(size, 3 * size, bias=config.qkv_proj_bias)
        self.out_proj = nn.Linear(size, size, bias=config.qkv_proj_bias)

    def forward(
        self,
        h: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) projected context, and (B, h, T, T) if asked."""
        # Wqkv's rows are q's heads, then k's, then v's.
        q, k, v = layout.heads(self.Wqkv(h), 3 * self.num_heads).chunk(3, dim=1)  # (B, H, T, hd)
        q, k = rotate_leading(q, rotary), rotate_leading(k, rotary)
        context, probs = attend(q, k, v, layout.key_mask, map_heads=map_heads)
        out: Tensor = self.out_proj(layout.merge_heads(context))
        return out, probs


class GatedMLP(nn.Module):
    """fc11's output times the gate of fc12's; then fc2."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.fc11 = nn.Linear(size, inner, bias=config.mlp_fc1_bias)
        self.fc12 = nn.Linear(size, inner, bias=config.mlp_fc1_bias)
        self.fc2 = nn.Linear(inner, size, bias=config.mlp_fc2_bias)
        self.gate = GATES[config.feed_forward]

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(self.fc11(x) * self.gate(self.fc12(x)))
        return out


class MLP(nn.Module):
    """fc1, exact GELU, fc2."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.fc1 = nn.Linear(size, inner, bias=config.mlp_fc1_bias)
        self.fc2 = nn.Linear(inner, size, bias=config.mlp_fc2_bias)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class Block(nn.Module):
    """Attention and feed-forward, each added to its input and then normed (post-norm)."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.attn = Attention(config)
        self.mlp: nn.Module = MLP(config) if config.feed_forward == "gelu" else GatedMLP(config)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(
        self,
        x: Tensor,
        layout: TokenLayout,
        rotary: tuple[Tensor, Tensor],
        map_heads: tuple[int, ...] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.attn(x, layout, rotary, map_heads)
        return in_row_chunks(self.feed_forward, self.norm1(x + context)), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.norm2(x + self.mlp(x))
        return out


class Stack(nn.Module):
    """The blocks, under the checkpoint's `encoder.layers`."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))


class NomicBertEncoder(Encoder):
    """Embeddings, their LayerNorm, then the post-norm blocks; no norm after the last."""

    config: NomicBertConfig

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
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
        x = self.emb_ln(self.embeddings(input_ids, token_type_ids))  # (B, T, D)
        rotary = self.rotary_tables(attention_mask, x.dtype)
        h = layout.pack(x)  # (N, D)
        h, kept = run_layers(self.encoder.layers, h, layout, maps, lambda index: (rotary,))
        return EncoderOutput(layout.unpack(h), kept)

    def rotary_tables(self, attention_mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(T, rd) cos and sin shared by every row, or (B, 1, T, rd) when scaled per row."""
        config, factor = self.config, self.config.rotary_scaling_factor
        if factor is not None:
            return stretched_rotary_tables(config, factor, attention_mask, dtype)
        width, device = attention_mask.shape[1], attention_mask.device
        return rotary_tables(config.rotary_emb_base, config.rotary_dim, width, device, dtype)
