"""A network's children and parameters bound as plain attributes, for a pass's reads.

`nn.Module` keeps its children and parameters in dictionaries of its own, so reading
`self.dense` in a forward pass first fails Python's own lookup, which builds an
AttributeError, and only then finds it through `nn.Module.__getattr__`. A BERT pass makes
about a hundred such reads a sentence; bound, a small model's pass ran 13% fewer instructions
(docs/benchmarks.md). Assigning a child or a parameter later (`setattr`,
`load_state_dict(assign=True)`) still works: `nn.Module.__setattr__` drops the bound copy
first, and the read takes the slower way again until the next binding. Buffers are left
alone: registering one again would not drop its copy.
"""

from __future__ import annotations

from torch import nn


def bind_attributes(*modules: nn.Module) -> None:
    """Every child and parameter of `modules` and of the modules inside them also in its
    owner's instance dictionary, where attribute reads look first."""
    for module in modules:
        for owner in module.modules():
            for registry in (owner._modules, owner._parameters):
                for name, value in registry.items():
                    if value is not None:
                        owner.__dict__[name] = value
