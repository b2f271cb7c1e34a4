"""Each reproduction script (examples/reproduce/) runs end to end with --smoke and writes its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    progress = [line for line in done.stdout.splitlines() if line.startswith("[") and " s] " in line]
    assert progress and all(": accuracy of x̄ " in line and "α_e" not in line for line in progress), progress
    for name in tables:
        text = (tmp_path / name).read_text()
        lines = text.splitlines()
        assert len(lines) >= 3 and lines[1].startswith("|---") and len({line.count("|") for line in lines}) == 1, text
        assert "nan" not in text and text.strip() in done.stdout
    if script == "decentlam":  # the bias check: DecentLaM's fixed point is closer to the optimum than DmSGD's
        rows = dict(
            line.strip("| ").split(" | ") for line in (tmp_path / "decentlam_bias.md").read_text().splitlines()[2:]
        )
        assert float(rows["decentlam"]) < float(rows["atc"])


def test_a_curve_of_one_point_shows_and_a_target_is_a_line() -> None:
    """Before, `--smoke`'s DecentLaM accuracy plot (one batch size: one point per curve) was empty, and
    consensus_control.png had no line for the target."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "examples" / "reproduce"))
    try:
        from common import draw
    finally:
        sys.path.remove(str(ROOT / "examples" / "reproduce"))
    figure = draw({"awc": [(256, 0.9)], "atc": [(256, 0.8)]}, "accuracy", markers=True, levels={"target 0.05": 0.05})
    (axes,) = figure.axes
    curves = {line.get_label(): line for line in axes.get_lines()}
    assert curves["awc"].get_marker() == "o" and list(curves["awc"].get_xdata()) == [256]
    assert list(curves["target 0.05"].get_ydata()) == [0.05, 0.05] and curves["target 0.05"].get_linestyle() == "--"
