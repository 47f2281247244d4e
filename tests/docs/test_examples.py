"""Every example in README.md and docs/*.md runs against a real server.

The examples are the fenced ```bash or ```sh blocks that start with `curl`, and every
```python block. They are written for the default model on `localhost:8080`; the test starts
the real server (`python -m app`, the default model) on a free port and runs each block with
`localhost:8080` replaced by that port. A curl block fails on an HTTP error status
(`--fail-with-body`), a Python block on any exception.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.app.test_server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ADDRESS = "localhost:8080"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    language: str  # "shell" or "python"
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            info, code = match.group(1), match.group(2)
            line = text.count("\n", 0, match.start()) + 1
            if info in ("bash", "sh") and code.lstrip().startswith("curl"):
                found.append(Example(page, line, "shell", code))
            elif info == "python":
                found.append(Example(page, line, "python", code))
    return found


EXAMPLES = examples()


def test_there_are_examples_and_each_names_the_substitutable_address() -> None:
    assert len(EXAMPLES) >= 3
    for example in EXAMPLES:
        assert ADDRESS in example.code, f"{example.name}: examples call {ADDRESS}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("examples"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.name for example in EXAMPLES])
def test_the_example_runs(example: Example, server: ServerProcess) -> None:
    code = example.code.replace(ADDRESS, f"127.0.0.1:{server.port}")
    if example.language == "shell":
        script = 'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n' + code
        command = ["bash", "-euo", "pipefail", "-c", script]
    else:
        command = [sys.executable, "-c", code]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, (
        f"{example.name} failed ({result.returncode}):\n{code}\n"
        f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-2000:]}"
    )
    assert result.stdout.strip(), f"{example.name} printed nothing"
