"""The narrow interface the service uses: load once, tokenize, run one padded batch, describe."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from model.architectures import Encoder
from model.attention import MapRequest
from model.bound import bind_attributes
from model.codec import TextCodec
from model.compiled import CompiledNetwork, compile_unavailable
from model.cuda_graphs import GraphedForward, IntGrid, padded_batch, wait_for
from model.device import DtypeChoice, cpu_flags, resolve_device, resolve_dtype
from model.errors import ConfigError
from model.heads import Head
from model.info import AttentionSpec, ModelInfo
from model.int8 import INT8, quantize_linears, weight_levels
from model.loading import load_model
from model.pipeline import EmbeddingPipeline
from model.prepacked import can_prepack, prepack_linears
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir
from model.shared_weights import WeightStore
from model.tasks import MODEL_TASKS
from model.tokenizer import Encoded, TextTokenizer, TokenizerInput
from model.vectors import FloatArray, finish

__all__ = [
    "AttentionSpec",
    "BatchOutput",
    "Embedder",
    "ModelInfo",
    "ModelInput",
    "PendingOutput",
]

ModelInput = Encoded | Sequence[int]


@dataclass(frozen=True)
class BatchOutput:
    """Float32 CPU results for one batch, in input order, padding removed. Per-input tensors
    are copies, so that keeping one does not keep the whole batch's tensor alive."""

    # (B, dimensions), by task. embed: the pipeline's vectors, before the cut and the norm;
    # classify: raw logits, one per label; sparse: SPLADE weights, one per vocabulary entry.
    pooled: Tensor
    token_embeddings: list[Tensor] | None  # per input (T_i, hidden_size)
    attentions: list[dict[int, Tensor]] | None  # per input, layer -> (h, T_i, T_i) or (T_i, T_i)

    def result(self) -> BatchOutput:
        """What `Embedder.launch` hands back for a pass that is complete (see `OnItsWay`)."""
        return self


class OnItsWay:
    """A graphed pass's pooled rows while the GPU still runs it: their copy into pinned CPU
    memory is queued behind the pass, and `result` waits for it. The caller's thread is free
    meanwhile (to answer the batch before, to choose the next)."""

    def __init__(self, pooled: Tensor, arrived: torch.cuda.Event) -> None:
        self._pooled = pooled
        self._arrived = arrived

    def result(self) -> BatchOutput:
        wait_for(self._arrived)
        return BatchOutput(self._pooled, None, None)


# What `Embedder.launch` returns: `result()` gives the batch's output, waiting if need be.
PendingOutput = BatchOutput | OnItsWay


# Most values of one padded grid of chunk token vectors that late chunking pools at once
# (64 MiB of float32): a text of many long chunks is pooled a group of chunks at a time.
POOL_GRID_VALUES = 16 << 20


class Embedder:
    """A loaded encoder with its tokenizer and what runs after it for the task (`info.task`):
    the embedding pipeline, or a classification or sparse head. Safe to call from one worker
    thread."""

    def __init__(
        self,
        network: Encoder,
        head: EmbeddingPipeline | Head,
        tokenizer: TextTokenizer,
        info: ModelInfo,
        *,
        cuda_graphs: bool = True,
        prepack: bool = True,
        compile: bool = False,
    ) -> None:
        self.network = network
        self.head = head
        self.tokenizer = tokenizer
        self.info = info
        # Prompts, tokenizing and decoding: what a front end does without the network.
        self.codec = TextCodec(info, tokenizer)
        self.prompt = self.codec.prompt
        self.tokenize = self.codec.tokenize
        self.tokenize_pairs = self.codec.tokenize_pairs
        self.decode = self.codec.decode
        first = next(network.parameters())
        self.device = first.device
        # Embeddings on a GPU run as captured graphs where the batch is small enough
        # (model/cuda_graphs.py); the other heads run eagerly.
        self.graphs: GraphedForward | None = None
        if cuda_graphs and self.device.type == "cuda" and isinstance(head, EmbeddingPipeline):
            self.graphs = GraphedForward(self.pooled_forward, self.device, info.max_input_tokens)
        # On a CPU the encoder's linear layers run on weights laid out once for their kernel
        # (model/prepacked.py); how many, for the log.
        self.prepacked = 0
        # Or in int8 where the operator asked for it (model/int8.py); how many.
        self.quantized = 0
        int8 = info.dtype == INT8
        if compile and (refusal := compile_unavailable(self.device, first.dtype)):
            raise ConfigError(refusal)
        if int8:
            self.quantized = quantize_linears(network, weight_levels(cpu_flags()), rowwise=compile)
        elif prepack and can_prepack(self.device, first.dtype):
            # Compiled passes trace the checkpoint's weights, kept beside the packed ones.
            self.prepacked = prepack_linears(network, traceable=compile)
        # Compiled where the operator asked for it (model/compiled.py); eager passes keep
        # their prepacked layers.
        self.compiled: CompiledNetwork | None = None
        if compile:
            pairs = MODEL_TASKS[info.task].reads_pairs and network.config.type_vocab_size > 1
            pipeline = head if isinstance(head, EmbeddingPipeline) else None
            self.compiled = CompiledNetwork(network, takes_types=pairs, pipeline=pipeline)
        # Last, once the layers are swapped: what each pass reads, found at once.
        bind_attributes(network, head)

    @classmethod
    def load(
        cls,
        model_id: str = DEFAULT_MODEL_ID,
        *,
        device: str = "auto",
        dtype: str = "auto",
        allow_download: bool = False,
        max_input_tokens: int | None = None,
        task: str = "auto",
        cuda_graphs: bool = True,
        prepack: bool = True,
        compile: bool = False,
    ) -> Embedder:
        folder = resolve_model_dir(model_id, allow_download=allow_download)
        target = resolve_device(device)
        return cls.from_folder(
            folder,
            target,
            resolve_dtype(dtype, target),
            model_id=model_id,
            max_input_tokens=max_input_tokens,
            task=task,
            cuda_graphs=cuda_graphs,
            prepack=prepack,
            compile=compile,
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
        task: str = "auto",
        cuda_graphs: bool = True,
        prepack: bool = True,
        compile: bool = False,
    ) -> Embedder:
        """`task`: "auto" serves what the folder declares (model/tasks/), or embed,
        classify or sparse; `max_input_tokens` can only lower the model's own limit;
        `cuda_graphs` off runs every forward pass on a GPU eagerly; `prepack` off runs a
        CPU's linear layers on torch's own `F.linear`; `compile` runs a CPU's passes on
        graphs that inductor compiles (model/compiled.py; `compile_passes`), not in
        float16."""
        choice = dtype if isinstance(dtype, DtypeChoice) else DtypeChoice(dtype, "asked for")
        loaded = load_model(
            folder,
            device,
            choice,
            task=task,
            model_id=model_id,
            max_input_tokens=max_input_tokens,
        )
        return cls(
            loaded.network,
            loaded.head,
            loaded.tokenizer,
            loaded.info,
            cuda_graphs=cuda_graphs,
            prepack=prepack,
            compile=compile,
        )

    def forward(
        self,
        batch: Sequence[ModelInput],
        *,
        token_embeddings: bool = False,
        attention: AttentionSpec | None = None,
    ) -> BatchOutput:
        """Run one batch (right-padded here); every input gets its row of `pooled`."""
        return self.launch(batch, token_embeddings=token_embeddings, attention=attention).result()

    def device_works(self) -> bool:
        """Whether the device still runs work. Some CUDA errors (an illegal memory access,
        a device-side assert) leave every later call failing, where only a new process
        helps; a CPU always does."""
        if self.device.type != "cuda":
            return True
        try:
            torch.ones(1, device=self.device).add_(1).item()  # waits for the device
        except Exception:  # torch.AcceleratorError, or whatever a broken context raises
            return False
        return True

    def launch(
        self,
        batch: Sequence[ModelInput],
        *,
        token_embeddings: bool = False,
        attention: AttentionSpec | None = None,
    ) -> PendingOutput:
        """`forward`, returning as soon as the work is queued where it can be: a graphed pass
        on a GPU comes back still running (`OnItsWay`), every other pass complete. Passes
        launched one after another run in that order."""
        if attention is not None:
            for layer in attention.layers:
                if not 0 <= layer < self.info.num_layers:
                    raise ValueError(f"attention layer {layer} outside [0, {self.info.num_layers})")
        ids = [item.ids if isinstance(item, Encoded) else list(item) for item in batch]
        prompts = [item.prompt_length if isinstance(item, Encoded) else 0 for item in batch]
        pad_id = self.network.config.pad_token_id
        shape = self.graph_shape(batch, token_embeddings=token_embeddings, attention=attention)
        if self.graphs is not None and shape is not None:
            with torch.inference_mode():
                return OnItsWay(*self.graphs.launch(ids, prompts, shape, pad_id))
        lengths = np.array([len(row) for row in ids], dtype=np.int64)
        width = int(lengths.max(initial=0))
        type_ids = _token_types(batch, width) if self._takes_types(batch) else None
        grid, mask, prompt_lengths = padded_batch(ids, prompts, (len(ids), width), pad_id)
        input_ids = _on(grid, self.device)
        attention_mask = _on(mask, self.device)
        maps = MapRequest(frozenset(attention.layers), attention.heads) if attention else None
        prompt_tensor = _on(prompt_lengths, self.device)
        with torch.inference_mode():
            types = type_ids.to(self.device) if type_ids is not None else None
            if self.compiled is not None and maps is None:  # a graph keeps no maps
                padded = bool(lengths.min(initial=width) < width)
                hidden, vectors = self.compiled(
                    input_ids, attention_mask, types, prompt_tensor, padded=padded
                )
                layer_maps: dict[int, Tensor] = {}
            else:
                out = self.network(input_ids, attention_mask, types, maps)
                hidden, layer_maps, vectors = out.hidden, out.maps, None
            if vectors is None:  # the pass ran no pipeline: the head runs now
                vectors = (
                    self.head(hidden, attention_mask, prompt_tensor)
                    if isinstance(self.head, EmbeddingPipeline)
                    else self.head(hidden, attention_mask)
                )
            pooled = vectors.cpu()
            tokens = None
            if token_embeddings:
                states = hidden.float().cpu()
                tokens = [states[row, :n].clone() for row, n in enumerate(lengths)]
            attentions = None
            if attention is not None:
                attentions = _per_input_maps(layer_maps, lengths, attention.mean)
        return BatchOutput(pooled, tokens, attentions)

    def graph_shape(
        self,
        batch: Sequence[ModelInput],
        *,
        token_embeddings: bool = False,
        attention: AttentionSpec | None = None,
    ) -> tuple[int, int] | None:
        """The captured shape `launch` replays a batch in (it then comes back still running);
        None where the pass runs eagerly and comes back complete."""
        if self.graphs is None or token_embeddings or attention is not None:
            return None
        if self._takes_types(batch):
            return None
        width = max((len(i.ids if isinstance(i, Encoded) else i) for i in batch), default=0)
        return self.graphs.bucket(len(batch), width)

    def _takes_types(self, batch: Sequence[ModelInput]) -> bool:
        """Whether the pass takes segment ids: some input is a pair, and the model has more
        than one token type (transformers' tokenizers for RoBERTa and XLM-R return none,
        whatever the pair template numbers)."""
        return self.network.config.type_vocab_size > 1 and any(
            isinstance(item, Encoded) and item.type_ids for item in batch
        )

    def pooled_forward(
        self, input_ids: Tensor, attention_mask: Tensor, prompt_lengths: Tensor
    ) -> Tensor:
        """An embedding model's forward pass, ids to pooled vectors: what the graphs capture."""
        assert isinstance(self.head, EmbeddingPipeline), "graphs are made for embeddings only"
        hidden = self.network(input_ids, attention_mask).hidden
        vectors: Tensor = self.head(hidden, attention_mask, prompt_lengths)
        return vectors

    def pool_spans(self, states: FloatArray, spans: Sequence[tuple[int, int]]) -> FloatArray:
        """Late chunking's pooling: each span of one text's token vectors (T, hidden), pooled
        as the model pools a whole input and run through its Dense modules; in groups of
        spans whose padded grid stays within POOL_GRID_VALUES."""
        if not isinstance(self.head, EmbeddingPipeline):
            raise ValueError("only an embedding model pools chunks")
        width = max(stop - start for start, stop in spans)
        rows = max(1, POOL_GRID_VALUES // (width * states.shape[1]))
        tokens = torch.from_numpy(states)
        pooled = []
        for first in range(0, len(spans), rows):
            group = spans[first : first + rows]
            grid = torch.zeros(len(group), width, states.shape[1])
            mask = torch.zeros(len(group), width, dtype=torch.int64)
            for row, (start, stop) in enumerate(group):
                grid[row, : stop - start] = tokens[start:stop]
                mask[row, : stop - start] = 1
            with torch.inference_mode():
                prompts = torch.zeros(len(group), dtype=torch.int64, device=self.device)
                vectors = self.head(grid.to(self.device), mask.to(self.device), prompts)
            pooled.append(vectors.float().cpu())
        result: FloatArray = torch.cat(pooled).numpy()
        return result

    def compile_passes(self, thread_counts: Collection[int] = ()) -> int:
        """Compile the passes for each of `thread_counts` (default: the thread count now)
        now, not on requests' time; how many graphs (0 where they run eagerly)."""
        if self.compiled is None:
            return 0
        return self.compiled.compile_all(thread_counts or [torch.get_num_threads()])

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs now, not on requests' time; how many (0 without them)."""
        if self.graphs is None:
            return 0
        with torch.inference_mode():
            return self.graphs.capture_all()

    def share_weights(self, store: WeightStore) -> bool:
        """Hold the weights in `store`, shared with the other processes of one server on a
        CPU (model/shared_weights.py); False where they stay private (a GPU's, for one)."""
        # Before compiling: the graphs hold the weights they were compiled with.
        assert self.compiled is None or not self.compiled.graphs, "share, then compile"
        if not store.adopt([self.network, self.head]):
            return False
        bind_attributes(self.network, self.head)  # the shared twins, set in place of the own
        return True

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


def _on(array: IntGrid, device: torch.device) -> Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def _token_types(batch: Sequence[ModelInput], width: int) -> Tensor:
    """(B, T) segments, 0 for the inputs that are one text."""
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
