"""A network's children and parameters bound as plain attributes (model/bound.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from model import Embedder
from model.bound import bind_attributes
from model.shared_weights import WeightStore


def unbound(module: nn.Module) -> list[str]:
    """Where a child or a parameter would be found through `nn.Module.__getattr__` only."""
    return [
        f"{type(owner).__name__}.{name}"
        for owner in module.modules()
        for registry in (owner._modules, owner._parameters)
        for name, value in registry.items()
        if value is not None and owner.__dict__.get(name) is not value
    ]


def test_reads_find_the_registered_objects_and_a_later_assignment_wins() -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert unbound(block)  # nn.Module keeps them in dictionaries of its own
    bind_attributes(block)
    assert unbound(block) == []
    first = block[0]
    assert isinstance(first, nn.Linear) and first.__dict__["weight"] is first.weight
    replacement = nn.Linear(4, 4)
    block[0] = replacement  # setattr(block, "0", replacement)
    assert block.__dict__.get("0") is not first and block[0] is replacement
    bind_attributes(block)
    assert replacement.__dict__["weight"] is replacement.weight
    replacement.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    # The pass reads the new weight, not the stale bound one: the product is the bias alone.
    assert torch.equal(replacement(torch.ones(1, 4)), replacement.bias.detach()[None])


def test_an_embedder_binds_its_network_and_head_and_binds_the_shared_weights_again(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    embedder = Embedder.from_folder(tiny_checkpoint, torch.device("cpu"), torch.float32)
    assert unbound(embedder.network) == [] and unbound(embedder.head) == []
    before = embedder.embed(["a short sentence"])
    assert embedder.share_weights(WeightStore(tmp_path))
    # The store swapped every parameter for its shared twin; the bound ones are the twins.
    assert unbound(embedder.network) == [] and unbound(embedder.head) == []
    assert torch.equal(embedder.embed(["a short sentence"]), before)
