"""The README's quickstart, run as a user runs it: Lightning's own launcher, 4 worker processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_digits_quickstart_reaches_90_percent() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"validation accuracy of the averaged model: ([0-9.]+)", done.stdout)
    assert match, done.stdout[-3000:]
    assert float(match.group(1)) >= 0.90
