"""Run folders that killed servers left behind are removed by the next server; those of
servers still running (any of their processes) and anything else are left alone."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from app.run_folder import MARKER, PREFIX, remove_abandoned

# A process that makes a run folder (or holds one it is given), says where, and waits.
MAKE = "from app.run_folder import create_run_folder; print(create_run_folder(), flush=True)"
HOLD = (
    "import sys; from pathlib import Path; from app.run_folder import hold; "
    "hold(Path(sys.argv[1])); print(sys.argv[1], flush=True)"
)
WAIT = "; import time; time.sleep(60)"


def started(code: str, *args: str, temp: Path) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen(
        [sys.executable, "-c", code + WAIT, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert process.stdout is not None
    if not select.select([process.stdout], [], [], 60)[0]:
        killed(process)
        raise AssertionError("the process said nothing within 60 s")
    return process, Path(process.stdout.readline().strip())


def killed(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.stdout is not None
    process.stdout.close()


def test_a_killed_server_s_folder_goes_once_none_of_its_processes_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = tmp_path / f"{PREFIX}not-a-run-folder"  # no marker: not ours to judge
    other.mkdir()
    planted = tmp_path / f"{PREFIX}planted"  # anyone may write in /tmp: a FIFO never opens
    planted.mkdir()
    os.mkfifo(planted / MARKER)
    supervisor, folder = started(MAKE, temp=tmp_path)
    try:
        child, _ = started(HOLD, str(folder), temp=tmp_path)
    except BaseException:
        killed(supervisor)
        raise
    try:
        assert folder.parent == tmp_path and (folder / MARKER).exists()
        assert remove_abandoned() == 0  # running
        killed(supervisor)
        assert remove_abandoned() == 0 and folder.exists()  # its child still runs
        killed(child)
        assert remove_abandoned() == 1 and not folder.exists()
        assert other.exists() and planted.exists() and remove_abandoned() == 0
    finally:
        for process in (supervisor, child):
            if process.poll() is None:
                killed(process)


def test_a_new_server_removes_what_killed_ones_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, left = started(MAKE, temp=tmp_path)
    killed(first)
    second, folder = started(MAKE, temp=tmp_path)
    try:
        assert not left.exists() and folder.exists()
    finally:
        killed(second)
