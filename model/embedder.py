"""The narrow interface the service uses: load once, tokenize, run one padded batch, describe."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.checkpoint import load_weights, read_json
from model.config import EncoderConfig
from model.errors import ConfigError
from model.layers import TransformerEncoder
from model.pooling import Pooling, finalize, pool, pooling_from_config
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir
from model.tokenizer import Direction, Encoded, TextTokenizer, TokenizerInput

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelInfo:
    """What the service reports about the loaded model."""

    model_id: str
    model_type: str
    dimensions: int
    max_input_tokens: int
    pooling: Pooling
    normalize: bool
    dtype: str
    device: str
    num_layers: int
    num_heads: int
    vocab_size: int
    prompts: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchOutput:
    """Float32 CPU results for one batch, in input order, padding removed."""

    pooled: Tensor  # (B, D), not normalised
    token_embeddings: list[Tensor] | None  # per input (T_i, D)
    attentions: list[dict[int, Tensor]] | None  # per input, layer -> (H, T_i, T_i)


@dataclass(frozen=True)
class FolderLayout:
    """The sentence-transformers files around `config.json` and the weights."""

    pooling: Pooling
    normalize: bool
    max_seq_length: int | None
    prompts: dict[str, str]


def resolve_device(device: str) -> torch.device:
    """'auto' picks the GPU when there is one; anything else must be a valid torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device {device!r} is not a valid torch device") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: only cpu and cuda are supported")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is float16 on CUDA and float32 on the CPU."""
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_layout(folder: Path) -> FolderLayout:
    """Pooling, Normalize, max_seq_length and prompts; plain HF folders get mean pooling."""
    modules = read_json(folder / "modules.json", required=False) or []
    if not isinstance(modules, list):
        raise ConfigError(f"{folder / 'modules.json'}: expected a JSON list")
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_dir = str(types.get("Pooling", {}).get("path", "1_Pooling"))
    pooling_file = folder / pooling_dir / "config.json"
    raw_pooling = read_json(pooling_file, required="Pooling" in types)
    pooling = pooling_from_config(raw_pooling, str(pooling_file)) if raw_pooling else Pooling.MEAN
    st_config = read_json(folder / "sentence_bert_config.json", required=False) or {}
    st_meta = read_json(folder / "config_sentence_transformers.json", required=False) or {}
    prompts = st_meta.get("prompts") or {}
    return FolderLayout(
        pooling=pooling,
        normalize="Normalize" in types,
        max_seq_length=st_config.get("max_seq_length"),
        prompts={str(k): str(v) for k, v in prompts.items()},
    )


class Embedder:
    """A loaded encoder with its tokenizer and pooling; safe to call from one worker thread."""

    def __init__(
        self, network: TransformerEncoder, tokenizer: TextTokenizer, info: ModelInfo
    ) -> None:
        self.network = network
        self.tokenizer = tokenizer
        self.info = info
        self.device = next(network.parameters()).device

    @classmethod
    def load(
        cls,
        model_id: str = DEFAULT_MODEL_ID,
        *,
        device: str = "auto",
        dtype: str = "auto",
        allow_download: bool = False,
        max_input_tokens: int | None = None,
    ) -> Embedder:
        folder = resolve_model_dir(model_id, allow_download=allow_download)
        target = resolve_device(device)
        return cls.from_folder(
            folder,
            target,
            resolve_dtype(dtype, target),
            model_id=model_id,
            max_input_tokens=max_input_tokens,
        )

    @classmethod
    def from_folder(
        cls,
        folder: Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        model_id: str | None = None,
        max_input_tokens: int | None = None,
    ) -> Embedder:
        """`max_input_tokens` can only lower the model's own limit."""
        raw_config: Any = read_json(folder / "config.json")
        if not isinstance(raw_config, dict):
            raise ConfigError(f"{folder / 'config.json'}: expected a JSON object")
        config = EncoderConfig.from_hf(raw_config, str(folder / "config.json"))
        layout = read_layout(folder)
        # Built on the meta device: no random init, and the loaded tensors become the
        # parameters (assign=True) instead of being copied into a second set of them.
        with torch.device("meta"):
            network = TransformerEncoder(config)
        expected = {key: value.shape for key, value in network.state_dict().items()}
        network.load_state_dict(load_weights(folder, expected), strict=True, assign=True)
        network.to(device=device, dtype=dtype).eval().requires_grad_(False)
        ceiling = config.max_positions
        max_tokens = min(layout.max_seq_length or ceiling, max_input_tokens or ceiling, ceiling)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(f"{tokenizer_file}: file not found")
        tokenizer = TextTokenizer.from_file(tokenizer_file, max_tokens, config.vocab_size)
        info = ModelInfo(
            model_id=model_id or str(folder),
            model_type=config.model_type,
            dimensions=config.hidden_size,
            max_input_tokens=max_tokens,
            pooling=layout.pooling,
            normalize=layout.normalize,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            vocab_size=config.vocab_size,
            prompts=layout.prompts,
        )
        log.info("loaded %s from %s on %s as %s", info.model_id, folder, device, info.dtype)
        return cls(network, tokenizer, info)

    def tokenize(
        self,
        inputs: Sequence[TokenizerInput],
        *,
        truncate: bool = True,
        direction: Direction = "right",
    ) -> list[Encoded]:
        return self.tokenizer.encode(inputs, truncate=truncate, direction=direction)

    def forward(
        self,
        batch: Sequence[Sequence[int]],
        *,
        token_embeddings: bool = False,
        attention_layers: Collection[int] = (),
    ) -> BatchOutput:
        """Run one right-padded batch of token-id lists."""
        for layer in attention_layers:
            if not 0 <= layer < self.info.num_layers:
                raise ValueError(f"attention layer {layer} outside [0, {self.info.num_layers})")
        lengths = [len(ids) for ids in batch]
        width = max(lengths, default=0)
        input_ids = torch.full((len(batch), width), self.network.config.pad_token_id)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        input_ids = input_ids.to(self.device, non_blocking=True)
        attention_mask = attention_mask.to(self.device, non_blocking=True)
        with torch.inference_mode():
            hidden, maps = self.network(input_ids, attention_mask, frozenset(attention_layers))
            pooled = pool(hidden, attention_mask, self.info.pooling).float().cpu()
            tokens = None
            if token_embeddings:
                states = hidden.float().cpu()
                tokens = [states[row, :n] for row, n in enumerate(lengths)]
            attentions = None
            if attention_layers:
                cpu_maps = {layer: probs.float().cpu() for layer, probs in maps.items()}
                attentions = [
                    {layer: probs[row, :, :n, :n] for layer, probs in cpu_maps.items()}
                    for row, n in enumerate(lengths)
                ]
        return BatchOutput(pooled, tokens, attentions)

    def embed(self, texts: Sequence[TokenizerInput], *, normalize: bool | None = None) -> Tensor:
        """Tokenize, run and finish in one call (normalised as the model's modules say)."""
        encoded = self.tokenize(texts)
        pooled = self.forward([e.ids for e in encoded]).pooled
        return finalize(pooled, self.info.normalize if normalize is None else normalize)
