"""`FaultPlan`: ranks kill themselves at the steps it names, once in the whole job, under a launcher that starts them
again; every process bounded (`BOUND`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_decentral.callbacks import FaultPlan

ROOT = Path(__file__).resolve().parents[1]
BOUND = 240.0  # seconds the launch may take (seconds alone; minutes when the 2 cores are shared ten ways)

SCRIPT = """
import os, sys
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_decentral import DecentralizedStrategy
from lightning_decentral.callbacks import FaultPlan
from tests.models import Regression, loader

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
with open(out / f"starts-{rank}", "a") as starts:
    starts.write("x")
saves = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=2, save_last=True)
trainer = pl.Trainer(
    strategy=DecentralizedStrategy(topology="ring"), accelerator="cpu", devices=2, max_steps=8,
    callbacks=[FaultPlan(kill={5: [1]}), saves], logger=False, enable_progress_bar=False,
    enable_model_summary=False, use_distributed_sampler=False,
)
resume = "last" if (out / "checkpoints" / "last.ckpt").exists() else None
trainer.fit(Regression(), loader(rank, 64, 8), ckpt_path=resume)
(out / f"ended-{rank}").write_text(str(trainer.global_step))
"""


@pytest.mark.slow
def test_a_rank_dies_where_the_plan_says_once_though_the_restart_begins_that_step_again(tmp_path: Path) -> None:
    """2 ranks under `torchrun --max-restarts 1`, a checkpoint every 2 steps, `FaultPlan(kill={5: [1]})`: rank 1
    dies when step 5 begins; torchrun starts both again from step 4, step 5 begins again and nobody dies (a second
    death would exceed the restarts); both end at step 8."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=BOUND, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "failed (exitcode: -9) local_rank: 1" in done.stderr, done.stderr[-3000:]  # SIGKILL, rank 1 only
    assert [(tmp_path / f"starts-{rank}").read_text() for rank in (0, 1)] == ["xx", "xx"]  # one restart of both
    assert [(tmp_path / f"ended-{rank}").read_text() for rank in (0, 1)] == ["8", "8"]


@pytest.mark.parametrize("kill", [{-1: [0]}, {3: 1}, {3: [True]}, [(3, [0])]])
def test_a_plan_that_names_no_step_or_rank_is_refused(kill) -> None:
    with pytest.raises(ValueError, match=r"FaultPlan\(kill=...\) maps optimizer steps"):
        FaultPlan(kill=kill)


def test_a_plan_that_names_a_rank_the_run_has_not_is_refused_before_training() -> None:
    import lightning.pytorch as pl

    from tests.models import Regression, loader

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[FaultPlan(kill={1: [0, 2]})],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"names ranks \[0, 2\], but the run has 1 \(0 to 0\): name ranks of the run"):
        trainer.fit(Regression(), loader(0, 16, 8))
    assert trainer.global_step == 0
