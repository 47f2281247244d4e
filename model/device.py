"""Choosing the device and the dtype at start-up, from what the hardware computes natively."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.errors import ConfigError
from model.int8 import INT8, int8_unavailable

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CPU flags (as Linux lists them) of instructions that compute bfloat16 natively.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    # The encoder's linear layers in int8 (model/int8.py); `dtype` is then everything else's.
    int8: bool = False

    @property
    def name(self) -> str:
        return "int8" if self.int8 else str(self.dtype).removeprefix("torch.")


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


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags, read at run time (empty where /proc/cpuinfo does not exist)."""
    return frozenset(_cpuinfo_field(cpuinfo, ("flags", "Features")).split())


def cpu_vendor(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's vendor as Linux names it (`GenuineIntel`, `AuthenticAMD`), or ""."""
    return _cpuinfo_field(cpuinfo, ("vendor_id",)).strip()


def _cpuinfo_field(cpuinfo: Path, keys: tuple[str, ...]) -> str:
    """The first processor's value of the first of `keys` found, or ""."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value
    return ""


def resolve_dtype(
    dtype: str, device: torch.device, flags: frozenset[str] | None = None
) -> DtypeChoice:
    """'auto': float16 on CUDA; on the CPU bfloat16 where it is computed natively (AMX or
    AVX-512 BF16; tests hold it to cosine >= 0.999 against float32), else float32."""
    if dtype == INT8:
        refusal = int8_unavailable(device)
        if refusal is not None:
            raise ConfigError(f"dtype int8: {refusal}")
        return DtypeChoice(torch.float32, "asked for", int8=True)
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}, int8")
        return DtypeChoice(DTYPES[dtype], "asked for")
    if device.type == "cuda":
        return DtypeChoice(torch.float16, "auto: CUDA computes float16 natively")
    native = [flag for flag in BF16_FLAGS if flag in (cpu_flags() if flags is None else flags)]
    if native:
        return DtypeChoice(torch.bfloat16, f"auto: the CPU has {native[0]}")
    return DtypeChoice(
        torch.float32, "auto: the CPU has no native bfloat16 (amx_bf16, avx512_bf16)"
    )
