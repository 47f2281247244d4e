"""`model`'s public names: the ones that need torch are imported on first use
(model/__init__.py), and every one of them resolves. That the supervisor's imports stay free
of torch is tests/app/test_workers.py's."""

from __future__ import annotations

import model


def test_every_public_name_resolves_and_the_lazy_ones_are_public() -> None:
    assert set(model._LAZY) <= set(model.__all__)
    assert set(model.__all__) <= set(dir(model))
    for name in model.__all__:
        assert getattr(model, name) is not None, name
