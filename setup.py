"""setuptools' build with one step more: the gRPC code generated from app/grpc/tei.proto
(app/grpc/generate.py, which needs grpcio-tools, a build requirement in pyproject.toml)
before the modules are collected, so that every install has it: `pip install .`, the
editable `pip install -e .` of `make install` and CI, and the Dockerfile's. The generated
modules are never committed. Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self) -> None:
        # Loaded from its path: the package itself is not importable while it is built.
        spec = importlib.util.spec_from_file_location(
            "tei_generate", ROOT / "app" / "grpc" / "generate.py"
        )
        assert spec is not None and spec.loader is not None
        generator = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generator)
        for path in generator.generate(ROOT):
            self.announce(f"generated {path.relative_to(ROOT)}", level=2)
        super().run()


setup(cmdclass={"build_py": BuildPy})
