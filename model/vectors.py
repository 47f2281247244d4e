"""Finished vectors as numpy arrays: what the engine hands on and the front end renders.

No torch here: the front end imports it too.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

# Vectors as the serving layer hands them on: float32 numpy arrays.
FloatArray = npt.NDArray[np.float32]


def finish(vectors: FloatArray, normalize: bool, dimensions: int | None = None) -> FloatArray:
    """Matryoshka: keep the first `dimensions` features, then L2-normalise if asked.

    (N, D) float32 in, a new C-contiguous (N, D') float32 array out.
    """
    cut = np.array(vectors[..., :dimensions] if dimensions else vectors, dtype=np.float32)
    if normalize:
        # What np.linalg.norm computes, without its checks (which cost more, on a batch).
        norms = np.sqrt(np.einsum("...d,...d->...", cut, cut))[..., None]
        cut /= np.maximum(norms, 1e-12)
    return cut
