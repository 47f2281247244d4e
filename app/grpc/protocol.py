"""The generated protobuf code for tei.proto, or a clear error saying how to make it.

The code is generated when the package is installed (app/grpc/generate.py) and never
committed; a checkout that was not installed since tei.proto changed lacks it.
"""

from __future__ import annotations

try:
    from app.grpc import tei_pb2 as pb
except ImportError as exc:  # the generated module is missing, or from another protobuf
    raise ImportError(
        f"the gRPC code generated from app/grpc/tei.proto cannot be imported ({exc}); it is "
        "generated at install time: run `make install` (or `pip install -e .`), or "
        "`python -m app.grpc.generate` where grpcio-tools is installed"
    ) from exc

__all__ = ["pb"]
