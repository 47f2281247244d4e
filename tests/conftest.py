from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import Embedder
from tests.helpers import make_random_checkpoint


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    make_random_checkpoint(folder)
    return folder


@pytest.fixture
def tiny_embedder(tiny_checkpoint: Path) -> Embedder:
    return Embedder.from_folder(tiny_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def minilm() -> Embedder:
    """The real all-MiniLM-L6-v2 from the installed package (CI installs it)."""
    return Embedder.load(device="cpu", dtype="float32")
