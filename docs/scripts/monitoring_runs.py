"""The runs behind docs/monitoring.md: the digits quickstart on a ring, on the complete graph, and on a
ring under ConsensusControl, each logged to CSV with the three monitors, then plotted.

From the repository root (about 30 s per run on 4 CPU workers)::

    python docs/scripts/monitoring_runs.py                      # all runs, then the plots
    python docs/scripts/monitoring_runs.py --runs ring complete # some of them

The logs go to ``logs/monitoring/<run>``; the figures to ``docs/img/monitoring`` through
``python -m lightning_decentral.plot``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ("ring", "complete", "ring-controlled")
TARGET = 0.005  # ConsensusControl: Ξ / ‖x̄‖ during the first 5 epochs (the ring peaks near 0.012)


def fit(name: str, log_dir: Path) -> None:
    """One run, 4 worker processes (Lightning relaunches this script with the same arguments)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from examples.digits import DigitsCNN, DigitsDataModule
    from lightning_decentral import DecentralizedStrategy
    from lightning_decentral.callbacks import ConsensusControl, ConsensusDistance, EffectiveLearningRate

    torch.set_num_threads(1)
    seed_everything(0)
    callbacks = [ConsensusDistance(every_n_steps=5), EffectiveLearningRate(every_n_steps=5)]
    if name == "ring-controlled":
        callbacks.insert(0, ConsensusControl(TARGET, reference="parameters", until_epoch=5, handover_epochs=0))
    trainer = Trainer(
        strategy=DecentralizedStrategy(topology="complete" if name == "complete" else "ring"),
        accelerator="cpu",
        devices=4,
        max_epochs=15,
        logger=CSVLogger(log_dir, name=name, version=0),
        log_every_n_steps=5,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--log-dir", default=str(ROOT / "logs" / "monitoring"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "monitoring"))
    parser.add_argument("--fit", choices=RUNS, help=argparse.SUPPRESS)  # one run, in its own processes
    args = parser.parse_args()
    if args.fit:
        fit(args.fit, Path(args.log_dir))
        return
    for name in args.runs:
        command = [sys.executable, __file__, "--fit", name, "--log-dir", args.log_dir]
        subprocess.run(command, cwd=ROOT, check=True)
    log_dirs = [str(Path(args.log_dir) / name) for name in RUNS if (Path(args.log_dir) / name).exists()]
    subprocess.run(
        [sys.executable, "-m", "lightning_decentral.plot", *log_dirs, "--out", args.out], cwd=ROOT, check=True
    )


if __name__ == "__main__":
    main()
