"""Reading a checkpoint folder's files, with errors that name the file and the key.

Weights come from `model.safetensors`, from shards listed in `model.safetensors.index.json`,
or from `pytorch_model.bin` (and its index), which is read with `weights_only=True` so that
it can hold tensors only, never arbitrary pickled code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from model.errors import CheckpointError, ConfigError
from model.resolve import WEIGHTS_FILE

log = logging.getLogger(__name__)

# In the order they are looked for.
WEIGHT_FILES = (
    WEIGHTS_FILE,
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


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


def read_json_object(path: Path, *, required: bool = True) -> dict[str, Any]:
    """A JSON file that must hold an object; an absent optional file reads as {}."""
    value = read_json(path, required=required)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


class TensorFile(Protocol):
    def keys(self) -> Iterator[str]: ...
    def get_tensor(self, key: str) -> torch.Tensor: ...


class _PickledTensors:
    """`pytorch_model.bin`, loaded with weights_only=True (tensors and plain containers only)."""

    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many types for a bad or unsafe pickle
            raise CheckpointError(
                f"{path}: not a loadable weights-only checkpoint ({exc})"
            ) from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: expected a dict of tensors")
        self.state: dict[str, torch.Tensor] = state

    def keys(self) -> Iterator[str]:
        return iter(self.state)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.state[key]


def weight_file(folder: Path) -> Path:
    """The first weights file found in a folder, in WEIGHT_FILES order."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder}: no weights file found (looked for {', '.join(WEIGHT_FILES)})")


@contextmanager
def open_weights(path: Path) -> Iterator[dict[str, TensorFile]]:
    """Every tensor key in a weights file (or in the shards its index lists) -> its file."""
    with ExitStack() as stack:
        if path.name.endswith(".index.json"):
            index = read_json_object(path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{path}: missing key 'weight_map'")
            shards = {name: _open(path.parent / name, stack) for name in set(weight_map.values())}
            yield {key: shards[name] for key, name in weight_map.items()}
        else:
            handle = _open(path, stack)
            yield dict.fromkeys(handle.keys(), handle)


def _open(path: Path, stack: ExitStack) -> TensorFile:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    if path.suffix == ".bin":
        return _PickledTensors(path)
    try:
        handle: TensorFile = stack.enter_context(safe_open(str(path), framework="pt"))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
    return handle


def weight_keys(folder: Path) -> frozenset[str]:
    """Every tensor key in the folder's weights (read from headers and indexes only, except for
    a pickled checkpoint)."""
    with open_weights(weight_file(folder)) as files:
        return frozenset(files)


def load_weights(
    folder: Path,
    expected: Mapping[str, torch.Size],
    prefixes: Sequence[str] = (),
    *,
    extra: Mapping[str, torch.Size] | None = None,
) -> dict[str, torch.Tensor]:
    """Read exactly the expected tensors from the folder's weights, checking every shape.

    `expected` keys are the encoder's own; a checkpoint saved from a task model
    (`bert.embeddings...`) is read through the first of `prefixes` that matches. `extra` keys
    (a task head's) are read as they are. Tensors nobody uses (a pooler, position_ids) are
    reported in the log.
    """
    path = weight_file(folder)
    try:
        with open_weights(path) as files:
            prefix = _key_prefix(set(files), expected, prefixes)
            wanted = {prefix + key: (key, shape) for key, shape in expected.items()}
            wanted.update({key: (key, shape) for key, shape in (extra or {}).items()})
            missing = sorted(name for name in wanted if name not in files)
            if missing:
                raise CheckpointError(
                    f"{path}: missing key {missing[0]!r} ({len(missing)} missing)"
                )
            tensors: dict[str, torch.Tensor] = {}
            for name, (key, shape) in wanted.items():
                tensor = files[name].get_tensor(name)
                if tensor.shape != shape:
                    raise CheckpointError(
                        f"{path}: key {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(shape)}"
                    )
                tensors[key] = tensor
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
    unused = sorted(name for name in files if name not in wanted)
    if unused:
        log.info("%s: ignoring %d unused tensors: %s", path, len(unused), ", ".join(unused))
    return tensors


def _key_prefix(keys: set[str], expected: Mapping[str, torch.Size], prefixes: Sequence[str]) -> str:
    probe = next(iter(expected))
    if probe in keys:
        return ""
    for prefix in prefixes:
        if prefix + probe in keys:
            return prefix
    return ""
