"""``python -m lightning_decentral.plot`` on the CSV and TensorBoard logs of a short real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_decentral.callbacks import ConsensusDistance, EffectiveLearningRate
from lightning_decentral.plot import find_runs, main, plot_runs, read_csv
from tests.models import loader
from tests.monitor_workers import TwoPart

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four steps on one process, logged by both loggers (one model: Ξ = 0, ratio 1)."""
    root = tmp_path_factory.mktemp("plot_logs")
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=[CSVLogger(root / "csv", name="run", version=0), TensorBoardLogger(root / "tb", name="run", version=0)],
        callbacks=[ConsensusDistance(every_n_steps=1), EffectiveLearningRate(every_n_steps=1)],
    )
    trainer.fit(TwoPart(), train_dataloaders=loader(0, 32, 8))
    return root


def test_tensorboard_and_csv_logs_hold_the_same_series(logged: Path) -> None:
    ((csv_label, from_csv),) = find_runs(logged / "csv")
    ((tb_label, from_tb),) = find_runs(logged / "tb")
    assert (csv_label, tb_label) == ("csv", "tb")  # named after the LOG_DIR holding one run
    for name in ("train_loss", "consensus/distance", "lr/effective_ratio"):
        assert [s for s, _ in from_tb[name]] == [s for s, _ in from_csv[name]] == [0, 1, 2, 3]
        assert [v for _, v in from_tb[name]] == pytest.approx([v for _, v in from_csv[name]], rel=1e-6)
    assert read_csv(logged / "csv" / "run" / "version_0" / "metrics.csv")["lr/effective_ratio"][0][1] == 1.0


def test_plot_runs_writes_one_png_per_quantity(logged: Path, tmp_path: Path) -> None:
    written = plot_runs([logged / "csv", logged / "tb"], tmp_path)
    assert sorted(p.name for p in written) == ["consensus_distance.png", "effective_lr_ratio.png", "loss.png"]
    assert all(p.stat().st_size > 1000 for p in written)


@pytest.mark.slow
def test_command_line(logged: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_decentral.plot", str(logged / "tb"), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [Path(line).name for line in done.stdout.split()] == [
        "loss.png",
        "consensus_distance.png",
        "effective_lr_ratio.png",
    ]
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000


def test_command_line_errors_name_the_fix(
    logged: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    assert "No log directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "No metrics.csv or events.out.tfevents.*" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main([str(logged / "csv"), "--out", str(tmp_path)]) == 2
    assert "pip install 'lightning-decentral[plot]'" in capsys.readouterr().err
