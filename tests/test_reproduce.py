"""Each reproduction script (examples/reproduce/) runs end to end with --smoke and writes its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("script", "tables"),
    [
        ("large_lr", ["large_lr_accuracy.md", "large_lr_effective_ratio.md"]),
        ("decentlam", ["decentlam_accuracy.md", "decentlam_bias.md"]),
        ("consensus", ["consensus_gap.md", "consensus_control.md"]),
    ],
)
def test_smoke_run_prints_and_writes_its_tables(script: str, tables: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reproduce" / f"{script}.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in tables:
        text = (tmp_path / name).read_text()
        lines = text.splitlines()
        assert len(lines) >= 3 and lines[1].startswith("|---") and len({line.count("|") for line in lines}) == 1, text
        assert "nan" not in text and text.strip() in done.stdout
    if script == "decentlam":  # the bias check: DecentLaM's fixed point is closer to the optimum than DmSGD's
        rows = dict(line.strip("| ").split(" | ") for line in (tmp_path / "decentlam_bias.md").read_text().splitlines()[2:])
        assert float(rows["decentlam"]) < float(rows["atc"])
