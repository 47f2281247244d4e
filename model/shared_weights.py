"""One copy of the weights for several engines on a CPU (`--devices cpu,cpu`), here called
workers, in a shared file.

Each worker loads the model as usual; then the first to get here writes its parameters and
buffers to the store's file, and every worker, that one included, points its modules at a
read-only shared mapping of it, after checking that the mapped values equal its own. Their
private copies are freed, so N workers hold these weights once, in the page cache (the memory
per process is in docs/benchmarks.md). What the file holds is what stays in ordinary tensors:
the linear layers' weights are prepacked for their kernel (model/prepacked.py, and int8's for
fbgemm) into opaque tensors of each process's own, so the file holds the embedding tables,
norms, biases and the heads' weights (all of them with `--no-prepack`, and a compiled int8
model's int8 weights and scales, which are plain).

A read-only mapping: a worker that wrote to a weight would crash on it, instead of changing
the vectors of every other worker. Weights that differ from the store's (which two workers
of one server never have) stay private, with a warning.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import mmap
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

# Each tensor starts on a cache line, as the allocator would place it.
ALIGNMENT = 64


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in the store's file."""

    name: str
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def size(self) -> int:
        return self.torch_dtype.itemsize * math.prod(self.shape)


class WeightStore:
    """A folder the supervisor makes for its workers; picklable (only its path travels)."""

    def __init__(self, folder: Path) -> None:
        self.data = folder / "weights.bin"
        self.manifest = folder / "weights.json"
        self.lock = folder / "weights.lock"

    def adopt(self, modules: Sequence[nn.Module]) -> bool:
        """Point the modules' CPU parameters and buffers at the store's copy, writing it
        first if no process has; False, the weights kept private, when the store holds other
        weights or cannot be written (a full or read-only disk: sharing only saves memory)."""
        tensors = _tensors(modules)
        if not tensors:
            return False
        own = _layout(tensors)
        try:
            with self._locked():
                if self.manifest.exists():
                    entries = _read(self.manifest)
                else:
                    self._write(own, tensors)
                    entries = own
            if entries != own:
                log.warning(
                    "%s holds another model's weights: this worker keeps its own", self.data
                )
                return False
            views = self._map(entries)
        except OSError as exc:
            log.warning("weights not shared, this worker keeps its own: %s", exc)
            return False
        mapped = dict(zip((name for name, _ in tensors), views, strict=True))
        if not all(torch.equal(mapped[name], tensor) for name, tensor in tensors):
            log.warning("%s holds other values than this worker loaded: kept its own", self.data)
            return False
        _rebind(modules, {id(tensor): mapped[name] for name, tensor in tensors})
        end = entries[-1].offset + entries[-1].size
        log.info("weights shared with the other workers (%d MiB)", end >> 20)
        return True

    @contextmanager
    def _locked(self) -> Iterator[None]:
        descriptor = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # drops the lock

    def _write(self, entries: Sequence[Entry], tensors: Sequence[tuple[str, Tensor]]) -> None:
        """The data, then the manifest, whose presence says the data is complete."""
        with self.data.open("wb") as handle:
            for entry, (_, tensor) in zip(entries, tensors, strict=True):
                handle.seek(entry.offset)
                handle.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
        self.manifest.write_text(json.dumps([entry.__dict__ for entry in entries]))

    def _map(self, entries: Sequence[Entry]) -> list[Tensor]:
        with self.data.open("rb") as handle:
            region = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            # torch warns that writing through a read-only buffer is undefined: here it is
            # meant to fault, and nothing writes to weights.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            data = torch.frombuffer(region, dtype=torch.uint8)
        return [
            data[e.offset : e.offset + e.size].view(e.torch_dtype).view(e.shape) for e in entries
        ]


def _tensors(modules: Sequence[nn.Module]) -> list[tuple[str, Tensor]]:
    """Every distinct CPU parameter and buffer, named by module position and path; none when
    any lies elsewhere (a GPU's weights are not the CPU's to share)."""
    found: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for index, module in enumerate(modules):
        named = chain(
            module.named_parameters(prefix=str(index)), module.named_buffers(prefix=str(index))
        )
        for name, tensor in named:
            if tensor.device.type != "cpu":
                return []
            if id(tensor) not in seen and tensor.numel():
                seen.add(id(tensor))
                found.append((name, tensor))
    return found


def _rebind(modules: Sequence[nn.Module], replacements: dict[int, Tensor]) -> None:
    """Swap each tensor for its mapped twin wherever a module holds it: a parameter tied
    into several modules stays one parameter."""
    twins: dict[int, nn.Parameter] = {}
    for module in chain.from_iterable(m.modules() for m in modules):
        for name, parameter in list(module.named_parameters(recurse=False)):
            if id(parameter) in replacements:
                if id(parameter) not in twins:
                    mapped = replacements[id(parameter)]
                    twins[id(parameter)] = nn.Parameter(mapped, requires_grad=False)
                setattr(module, name, twins[id(parameter)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            if id(buffer) in replacements:
                setattr(module, name, replacements[id(buffer)])


def _layout(tensors: Sequence[tuple[str, Tensor]]) -> list[Entry]:
    """Where each tensor goes in the file, one after another, each on a cache line. The same
    tensors always get the same layout, so a manifest that differs names another model."""
    entries, offset = [], 0
    for name, tensor in tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append(Entry(name, dtype, tuple(tensor.shape), offset))
        offset = -(-(offset + entries[-1].size) // ALIGNMENT) * ALIGNMENT
    return entries


def _read(manifest: Path) -> list[Entry]:
    return [
        Entry(item["name"], item["dtype"], tuple(item["shape"]), item["offset"])
        for item in json.loads(manifest.read_text())
    ]
