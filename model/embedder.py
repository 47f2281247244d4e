"""The narrow interface the service uses: load once, tokenize, run one padded batch, describe."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from model.architectures import Encoder, EncoderConfig, config_from_hf
from model.attention import MapRequest
from model.checkpoint import load_weights, read_json_object
from model.device import DtypeChoice, resolve_device, resolve_dtype
from model.errors import ConfigError, PromptError
from model.folder import DenseModule, FolderSpec, read_folder
from model.pipeline import Dense, EmbeddingPipeline, Normalize, finish
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir
from model.tokenizer import Direction, Encoded, TextTokenizer, TokenizerInput

log = logging.getLogger(__name__)

ModelInput = Encoded | Sequence[int]


@dataclass(frozen=True)
class ModelInfo:
    """What the service reports about the loaded model."""

    model_id: str
    model_type: str
    dimensions: int  # of the vectors the pipeline gives (after any Dense layer)
    hidden_size: int  # of the per-token vectors
    max_input_tokens: int
    pooling: tuple[str, ...]
    include_prompt: bool
    dense: tuple[str, ...]  # "in -> out, Activation" per Dense layer
    normalize: bool
    dtype: str
    dtype_reason: str
    device: str
    num_layers: int
    num_heads: int
    vocab_size: int
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    do_lower_case: bool = False
    similarity_fn_name: str = "cosine"


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The attention maps an input asks for, resolved against the model (0-based indices)."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    mean: bool = False

    @property
    def maps_per_layer(self) -> int:
        """(T x T) maps each layer returns: one per head, or one for the mean."""
        return 1 if self.mean else len(self.heads)


@dataclass(frozen=True)
class BatchOutput:
    """Float32 CPU results for one batch, in input order, padding removed. Per-input tensors
    are copies, so that keeping one does not keep the whole batch's tensor alive."""

    pooled: Tensor  # (B, dimensions): the pipeline's vectors, before the cut and the norm
    token_embeddings: list[Tensor] | None  # per input (T_i, hidden_size)
    attentions: list[dict[int, Tensor]] | None  # per input, layer -> (h, T_i, T_i) or (T_i, T_i)


class Embedder:
    """A loaded encoder with its tokenizer and pipeline; safe to call from one worker thread."""

    def __init__(
        self,
        network: Encoder,
        pipeline: EmbeddingPipeline,
        tokenizer: TextTokenizer,
        info: ModelInfo,
    ) -> None:
        self.network = network
        self.pipeline = pipeline
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
        dtype: torch.dtype | DtypeChoice,
        *,
        model_id: str | None = None,
        max_input_tokens: int | None = None,
    ) -> Embedder:
        """`max_input_tokens` can only lower the model's own limit."""
        choice = dtype if isinstance(dtype, DtypeChoice) else DtypeChoice(dtype, "asked for")
        spec = read_folder(folder)
        source = spec.transformer_dir / "config.json"
        config = config_from_hf(read_json_object(source), str(source))
        network = load_network(config, spec.transformer_dir, device, choice.dtype)
        pipeline = load_pipeline(spec, config.hidden_size).to(device)
        ceiling = config.max_positions
        max_tokens = min(spec.max_seq_length or ceiling, max_input_tokens or ceiling, ceiling)
        tokenizer_file = spec.transformer_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(f"{tokenizer_file}: file not found")
        tokenizer = TextTokenizer.from_file(
            tokenizer_file, max_tokens, config.vocab_size, lowercase=spec.do_lower_case
        )
        info = ModelInfo(
            model_id=model_id or str(folder),
            model_type=config.model_type,
            dimensions=pipeline.dimensions(config.hidden_size),
            hidden_size=config.hidden_size,
            max_input_tokens=max_tokens,
            pooling=tuple(str(mode) for mode in spec.pooling.modes),
            include_prompt=spec.pooling.include_prompt,
            dense=tuple(
                f"{s.spec.in_features} -> {s.spec.out_features}, {s.spec.activation}"
                for s in spec.steps
                if isinstance(s, DenseModule)
            ),
            normalize=pipeline.normalize,
            dtype=choice.name,
            dtype_reason=choice.reason,
            device=str(device),
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            vocab_size=config.vocab_size,
            prompts=dict(spec.prompts),
            default_prompt_name=spec.default_prompt_name,
            do_lower_case=spec.do_lower_case,
            similarity_fn_name=spec.similarity_fn_name,
        )
        log.info(
            "loaded %s from %s on %s as %s (%s)",
            info.model_id,
            folder,
            device,
            info.dtype,
            info.dtype_reason,
        )
        return cls(network, pipeline, tokenizer, info)

    def prompt(self, name: str | None) -> str:
        """The text a prompt name stands for: None is the model's default prompt (if any),
        "" is no prompt."""
        if name is None:
            name = self.info.default_prompt_name
        if not name:
            return ""
        if name not in self.info.prompts:
            known = ", ".join(sorted(self.info.prompts)) or "none"
            raise PromptError(f"unknown prompt_name {name!r} (this model's prompts: {known})")
        return self.info.prompts[name]

    def tokenize(
        self,
        inputs: Sequence[TokenizerInput],
        *,
        truncate: bool = True,
        direction: Direction = "right",
        prompt_name: str | None = None,
        add_special_tokens: bool = True,
    ) -> list[Encoded]:
        return self.tokenizer.encode(
            inputs,
            truncate=truncate,
            direction=direction,
            add_special_tokens=add_special_tokens,
            prompt=self.prompt(prompt_name),
        )

    def tokenize_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        truncate: bool = True,
        direction: Direction = "right",
    ) -> list[Encoded]:
        """Pairs of texts (a query and a text, for a cross-encoder) by the tokenizer's pair
        template, cut longest-first as transformers does."""
        return self.tokenizer.encode_pairs(pairs, truncate=truncate, direction=direction)

    def forward(
        self,
        batch: Sequence[ModelInput],
        *,
        token_embeddings: bool = False,
        attention: AttentionSpec | None = None,
    ) -> BatchOutput:
        """Run one batch (right-padded here); every input gets its pooled vector."""
        if attention is not None:
            for layer in attention.layers:
                if not 0 <= layer < self.info.num_layers:
                    raise ValueError(f"attention layer {layer} outside [0, {self.info.num_layers})")
        ids = [item.ids if isinstance(item, Encoded) else list(item) for item in batch]
        lengths = np.array([len(row) for row in ids], dtype=np.int64)
        width = int(lengths.max(initial=0))
        grid = np.full((len(ids), width), self.network.config.pad_token_id, dtype=np.int64)
        for row, sequence in enumerate(ids):
            grid[row, : len(sequence)] = sequence
        mask = np.arange(width) < lengths[:, None]
        type_ids = _token_types(batch, width)
        prompt_lengths = torch.tensor(
            [item.prompt_length if isinstance(item, Encoded) else 0 for item in batch]
        )
        input_ids = torch.from_numpy(grid).to(self.device, non_blocking=True)
        attention_mask = torch.from_numpy(mask.astype(np.int64)).to(self.device)
        maps = MapRequest(frozenset(attention.layers), attention.heads) if attention else None
        with torch.inference_mode():
            types = type_ids.to(self.device) if type_ids is not None else None
            out = self.network(input_ids, attention_mask, types, maps)
            pooled = self.pipeline(out.hidden, attention_mask, prompt_lengths.to(self.device)).cpu()
            tokens = None
            if token_embeddings:
                states = out.hidden.float().cpu()
                tokens = [states[row, :n].clone() for row, n in enumerate(lengths)]
            attentions = None
            if attention is not None:
                attentions = _per_input_maps(out.maps, lengths, attention.mean)
        return BatchOutput(pooled, tokens, attentions)

    def embed(
        self,
        texts: Sequence[TokenizerInput],
        *,
        normalize: bool | None = None,
        prompt_name: str | None = None,
    ) -> Tensor:
        """Tokenize, run and finish in one call (normalised as the model's modules say)."""
        encoded = self.tokenize(texts, prompt_name=prompt_name)
        pooled = self.forward(encoded).pooled.numpy()
        done = finish(pooled, self.info.normalize if normalize is None else normalize)
        return torch.from_numpy(done)


def load_network(
    config: EncoderConfig, folder: Path, device: torch.device, dtype: torch.dtype
) -> Encoder:
    """Built on the meta device: no random init, and the loaded tensors become the parameters
    (assign=True) instead of being copied into a second set of them."""
    with torch.device("meta"):
        network = config.build()
    expected = {key: value.shape for key, value in network.state_dict().items()}
    weights = load_weights(folder, expected, config.checkpoint_prefixes)
    network.load_state_dict(weights, strict=True, assign=True)
    network.reset_buffers()
    return network.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_pipeline(spec: FolderSpec, hidden_size: int) -> EmbeddingPipeline:
    """Pooling, then each Dense (its weights checked against the size it receives) or
    Normalize; Dense layers stay in float32 whatever the encoder's dtype."""
    if spec.pooling_dimension not in (None, hidden_size):
        raise ConfigError(
            f"pooling config: embedding dimension {spec.pooling_dimension} does not match the "
            f"encoder's hidden_size {hidden_size}"
        )
    size = hidden_size * len(spec.pooling.modes)
    steps: list[nn.Module] = []
    for index, step in enumerate(spec.steps):
        if isinstance(step, DenseModule):
            if step.spec.in_features != size:
                raise ConfigError(
                    f"{step.folder / 'config.json'}: in_features {step.spec.in_features} does "
                    f"not match the {size} features it receives"
                )
            with torch.device("meta"):
                dense = Dense(step.spec)
            expected = {key: value.shape for key, value in dense.state_dict().items()}
            dense.load_state_dict(load_weights(step.folder, expected), strict=True, assign=True)
            steps.append(dense.float().eval().requires_grad_(False))
            size = step.spec.out_features
        elif index < len(spec.steps) - 1:
            steps.append(Normalize())
    trailing_norm = bool(spec.steps) and not isinstance(spec.steps[-1], DenseModule)
    return EmbeddingPipeline(spec.pooling, steps, normalize=trailing_norm)


def _token_types(batch: Sequence[ModelInput], width: int) -> Tensor | None:
    """(B, T) segments when any input is a pair; None when every input is one text."""
    if not any(isinstance(item, Encoded) and item.type_ids for item in batch):
        return None
    types = np.zeros((len(batch), width), dtype=np.int64)
    for row, item in enumerate(batch):
        if isinstance(item, Encoded) and item.type_ids:
            types[row, : len(item.type_ids)] = item.type_ids
    return torch.from_numpy(types)


def _per_input_maps(
    maps: dict[int, Tensor], lengths: np.ndarray, mean: bool
) -> list[dict[int, Tensor]]:
    """Each input's (h, T_i, T_i) maps (or their mean over heads), copied out of the batch."""
    cpu = {layer: probs.float().cpu() for layer, probs in maps.items()}
    per_input = []
    for row, n in enumerate(lengths):
        kept = {}
        for layer, probs in cpu.items():
            own = probs[row, :, :n, :n]
            kept[layer] = own.mean(dim=0) if mean else own.clone()
        per_input.append(kept)
    return per_input
