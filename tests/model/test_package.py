"""`model`'s public names: the ones that need torch are imported on first use
(model/__init__.py), and every one of them resolves."""

from __future__ import annotations

import subprocess
import sys

import model


def test_every_public_name_resolves_and_the_lazy_ones_are_public() -> None:
    assert set(model._LAZY) <= set(model.__all__)
    assert set(model.__all__) <= set(dir(model))
    for name in model.__all__:
        assert getattr(model, name) is not None, name


def test_the_package_and_its_errors_import_without_torch() -> None:
    code = (
        "import sys; from model import DEFAULT_MODEL_ID, ModelError; "
        "print('torch' in sys.modules); from model import Embedder; print('torch' in sys.modules)"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert imported.stdout.split() == ["False", "True"], imported.stderr
