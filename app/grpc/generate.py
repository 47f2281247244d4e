"""Generates the Python code for tei.proto: tei_pb2.py (the messages), tei_pb2.pyi (their
types) and tei_pb2_grpc.py (client stubs), beside it.

Run at install time by setup.py's build step (every `pip install`, `make install`, the
Dockerfile), or by hand after editing the .proto: `python -m app.grpc.generate`. Needs
grpcio-tools, whose protoc writes code for the protobuf runtime of its own version, hence
one pinned version in pyproject.toml's build requirements and constraints.txt. Imports
nothing of the app, so that setup.py can load it from its path.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).with_name("tei.proto")
GENERATED = ("tei_pb2.py", "tei_pb2.pyi", "tei_pb2_grpc.py")


def generate(root: Path | None = None) -> list[Path]:
    """Write the generated modules into the package folder under `root` (the project's
    root: protoc names imports after the .proto's path from there, `app.grpc.tei_pb2`)."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - said to whoever installs
        raise SystemExit(
            "generating the gRPC code needs grpcio-tools: pip install -c constraints.txt "
            "grpcio-tools"
        ) from exc
    root = root or PROTO.parents[2]
    proto = root / "app" / "grpc" / PROTO.name
    out = str(root)
    code = protoc.main(
        [
            "protoc",
            f"--proto_path={root}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto.relative_to(root)),
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed on {proto} (exit code {code})")
    return [proto.with_name(name) for name in GENERATED]


if __name__ == "__main__":
    for path in generate():
        print(f"wrote {path}", file=sys.stderr)
