"""``benchmarks/transport.py`` runs end to end on two small messages (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_transport_smoke(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "transport.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["bytes"] for row in rows] == [4096, 65536]
    for row in rows:  # every transport was timed (after its result was checked against p2p's)
        assert set(row["median_s"]) == {"p2p", "edge_allreduce", "edge_broadcast", "allgather", "allreduce"}
        assert all(t > 0 for t in row["median_s"].values())
