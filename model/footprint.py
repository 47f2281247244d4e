"""What a model's weights take in memory at the dtype it will run in, read from its
safetensors headers (no weights loaded, no torch): the start-up check against an operator's
memory budget."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# Bytes per weight by serving dtype. auto may choose float32 (a CPU without bfloat16), so it
# is counted at float32's: an upper bound. int8 keeps embeddings and norms in float32; most
# of an encoder's weights are in its linear layers, counted at one byte and their scales.
BYTES_PER_WEIGHT = {"float32": 4.0, "auto": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.5}
# safetensors' 8-byte little-endian header length.
_LENGTH = struct.Struct("<Q")


def weight_count(folder: Path) -> int:
    """The weights in every safetensors file of a model folder and its module folders; a
    folder in PyTorch's pickle format counted by its files' size, as float32."""
    safetensors = sorted([*folder.glob("*.safetensors"), *folder.glob("*/*.safetensors")])
    if not safetensors:
        pickles = [*folder.glob("*.bin"), *folder.glob("*/*.bin")]
        return sum(path.stat().st_size for path in pickles) // 4
    total = 0
    for path in safetensors:
        with path.open("rb") as file:
            (length,) = _LENGTH.unpack(file.read(_LENGTH.size))
            header = json.loads(file.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for size in tensor["shape"]:
                    count *= size
                total += count
    return total


def weight_bytes(folder: Path, dtype: str) -> int:
    return int(weight_count(folder) * BYTES_PER_WEIGHT[dtype])
