"""The engine: one per device, it owns the model, the batch queue and the finishing of each
task's outputs; front ends reach it through the narrow protocol in `protocol.py`, in the same
process (`local.py`) or from other processes (`remote.py` to `process.py`, over Unix sockets).

Only `batcher`, `compute`, `model_engine`, `local` and `process` import torch; a front end
imports `protocol`, `wire`, `state` and `remote`, which never do.
"""
