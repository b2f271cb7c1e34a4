"""Checkpoint files on a filesystem other than the system temporary directory: a full disk or a killed writer never
leaves a damaged checkpoint where a good one was.

Each scenario of tests/filesystems.py runs in a private mount namespace (`unshare --mount --map-root-user`) over a
tmpfs of its own, small enough to fill; the test is skipped where the kernel refuses such a namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]


def _in_a_tmpfs(scenario: str, directory: Path, size: str, timeout: float = 240) -> dict[str, Any]:
    """Run the scenario over a tmpfs of `size` mounted at `directory` (visible to the scenario only)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small filesystem")
    probe = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {probe.stderr.strip()}")
    command = f'mount -t tmpfs -o size={size} tmpfs "$1" && exec "$2" -m tests.filesystems "$3" "$1"'
    run = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", command, "sh", str(directory), sys.executable, scenario],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_full_disk_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    """The shards of the second save fit, its file does not: before, Lightning wrote the file to the system temporary
    directory and copied it over last.ckpt, which the full disk left cut short (it did not load)."""
    result = _in_a_tmpfs("full_disk", tmp_path, size="4m")
    assert "No space left on device" in result["error"], result
    assert result["last"] == {"step": 1, "shards": [1, 1]}, result
    assert result["files"] == ["last.ckpt", "last.ckpt.shards"]  # no temporary file left


def test_a_writer_killed_while_writing_leaves_a_whole_checkpoint(tmp_path: Path) -> None:
    """`kill -9` the moment the file of the second save starts: last.ckpt is the first or the second save, whole."""
    result = _in_a_tmpfs("killed_writer", tmp_path, size="512m")
    assert "error" not in result["last"], result
    assert result["last"]["step"] in (1, 2) and set(result["last"]["shards"]) == {result["last"]["step"]}, result
