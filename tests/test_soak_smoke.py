"""benchmarks/soak.py runs end to end for a few steps (the figures themselves are in docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here runs a benchmark script in processes of its own

ROOT = Path(__file__).resolve().parents[1]


def test_soak_smoke(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "soak.py"),
            "--processes",
            "2",
            "--steps",
            "8",
            "--window",
            "4",
            "--checkpoint-every",
            "4",
            "--methods",
            "decentlam",
            "--check-elements",
            "1000",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    methods = json.loads(out.read_text())["methods"]
    assert [m["method"] for m in methods] == ["decentlam"]
    assert [w["step"] for w in methods[0]["windows"]] == [4, 8]
    assert methods[0]["windows"][0]["rss_mb_max"] > 0
