"""An encoder's weights, and a task head's beside them, loaded from a folder's checkpoint.

Networks are built on the meta device, with the modules' random starts skipped, and the
loaded tensors become the parameters (assign=True) instead of being copied into a second set
of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from model.architectures import Encoder, EncoderConfig
from model.architectures.base import ConfigReader
from model.architectures.bert import TransformerEncoder
from model.checkpoint import load_weights, weight_file, weight_keys
from model.errors import CheckpointError
from model.folder import FolderSpec
from model.heads import Head, MaskedLMHead

# How modules draw their random starts (torch.nn.init's functions, each of which asks the
# active modes first, and the tensor methods under them): every weight here comes from the
# checkpoint, and on the meta device the first normal_ imports torch._dynamo (seconds of
# every start-up).
RANDOM_STARTS = frozenset(
    {
        nn.init.normal_,
        nn.init.uniform_,
        nn.init.trunc_normal_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
    }
)


class _NoRandomStarts(TorchFunctionMode):
    """The random starts as no-ops, on this thread, while it is entered."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in RANDOM_STARTS:  # torch.nn.init passes its `tensor` by name
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside are on the meta device, without their random starts: their
    weights come from a checkpoint."""
    with torch.device("meta"), _NoRandomStarts():
        yield


def load_network(
    config: EncoderConfig, folder: Path, device: torch.device, dtype: torch.dtype
) -> Encoder:
    with on_meta():
        network = config.build()
    weights = load_weights(folder, shapes(network), config.checkpoint_prefixes)
    return _finish_network(network, weights, device, dtype)


def load_network_with_head(
    config: EncoderConfig,
    raw: ConfigReader,
    spec: FolderSpec,
    head: Head,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Encoder, Head]:
    """The encoder and the task's head (built on the meta device) from one checkpoint."""
    with on_meta():
        network = config.build()
    head_shapes = shapes(head)
    under_prefix = {k: v for k, v in head_shapes.items() if k.startswith(head.encoder_side)}
    own = {k: v for k, v in head_shapes.items() if k not in under_prefix}
    _check_head_weights(spec, raw, head, own)
    weights = load_weights(
        spec.transformer_dir,
        {**shapes(network), **under_prefix},
        config.checkpoint_prefixes,
        extra=own,
    )
    head_weights = {key: weights.pop(key) for key in head_shapes}
    network = _finish_network(network, weights, device, dtype)
    head.load_state_dict(head_weights, strict=True, assign=True)
    # A classification head is small and runs in float32, like Dense layers. A masked-LM
    # head's vocabulary matrix is as large as the word embeddings (it may be them): it stays
    # in the encoder's dtype, and only its outputs are taken to float32.
    head_dtype = dtype if isinstance(head, MaskedLMHead) else torch.float32
    head = head.to(device=device, dtype=head_dtype).eval().requires_grad_(False)
    if isinstance(head, MaskedLMHead) and head.tied:
        # Heads exist for BERT-family encoders only (model/heads.py).
        assert isinstance(network, TransformerEncoder)
        head.tie(network.embeddings.word_embeddings)
    return network, head


def _finish_network(
    network: Encoder, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Encoder:
    network.load_state_dict(weights, strict=True, assign=True)
    network.reset_buffers()
    return network.to(device=device, dtype=dtype).eval().requires_grad_(False)


def shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {key: value.shape for key, value in module.state_dict().items()}


def _check_head_weights(
    spec: FolderSpec, raw: ConfigReader, head: Head, own: Mapping[str, torch.Size]
) -> None:
    """A checkpoint without the task's head is refused by what it lacks, not as corrupt."""
    missing = sorted(set(own) - weight_keys(spec.transformer_dir))
    if missing:
        architectures = ", ".join(map(str, raw.raw.get("architectures") or ["not given"]))
        raise CheckpointError(
            f"{weight_file(spec.transformer_dir)}: task {spec.task.value!r} needs "
            f"{head.description}, and key {missing[0]!r} is missing ({len(missing)} of the "
            f"head's keys missing; {raw.source} architectures: {architectures})"
        )
