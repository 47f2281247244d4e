"""Reading a checkpoint folder's files, with errors that name the file and the key."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from model.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def read_json(path: Path, *, required: bool = True) -> Any:
    """Parse a JSON file; a missing required file or bad JSON names the file."""
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: file not found")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def load_weights(folder: Path, expected: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Read exactly the expected tensors from `model.safetensors`, checking every shape.

    A checkpoint saved from a task model (`bert.embeddings...`) is read through its prefix.
    Tensors the architecture does not use (a pooler head, position_ids) are reported.
    """
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            prefix = _key_prefix(keys, expected)
            missing = sorted(k for k in expected if prefix + k not in keys)
            if missing:
                raise CheckpointError(
                    f"{path}: missing key {missing[0]!r} ({len(missing)} missing)"
                )
            tensors: dict[str, torch.Tensor] = {}
            for key, shape in expected.items():
                tensor = handle.get_tensor(prefix + key)
                if tensor.shape != shape:
                    raise CheckpointError(
                        f"{path}: key {key!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(shape)}"
                    )
                tensors[key] = tensor
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
    unexpected = sorted(k for k in keys if k.removeprefix(prefix) not in expected)
    if unexpected:
        log.info("%s: ignoring %d unused tensors: %s", path, len(unexpected), ", ".join(unexpected))
    return tensors


def _key_prefix(keys: set[str], expected: Mapping[str, torch.Size]) -> str:
    probe = next(iter(expected))
    if probe in keys:
        return ""
    for key in keys:
        if key.endswith("." + probe):
            return key[: -len(probe)]
    return ""
