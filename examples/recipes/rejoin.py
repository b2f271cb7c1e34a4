"""Surviving and rejoining: a worker is killed mid-run, the others go on without it, and the launcher starts it again
and it rejoins the run in progress.

    lightning-decentral-launch --nproc-per-node 3 --max-restarts 1 examples/recipes/rejoin.py --kill 1:10

Rank 1 kills itself (SIGKILL) when step 10 starts, the first time only. Ranks 0 and 2 agree it is lost and train on
among themselves; the launcher starts rank 1 again (the same command); it asks to rejoin, the members admit it at a
step they agree on, a neighbour hands it its live state, and from that step the three mix again
(docs/reliability/rejoining.md). Each worker prints what it survived. `--step-time` emulates compute: the run must
outlast the restarted worker's start, which is seconds of imports on a small CPU machine; a real model needs none.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy


class Digits(LightningModule):
    """An MLP on scikit-learn's 8×8 digits."""

    def __init__(self, step_time: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.step_time = step_time

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_time)  # emulated compute
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class KillOnce(Callback):
    """Rank `rank` kills itself when step `step` starts, unless `mark` says it did already (its second start)."""

    def __init__(self, rank: int, step: int, mark: Path) -> None:
        self.rank, self.step, self.mark = rank, step, mark

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        if int(os.environ["RANK"]) == self.rank and trainer.global_step == self.step and not self.mark.exists():
            self.mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill", default="1:10", help="RANK:STEP, the worker killed and when")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--step-time", type=float, default=0.1, help="emulated compute per step, seconds")
    parser.add_argument("--root", default="logs/recipes/rejoin", help="where the kill is marked")
    args = parser.parse_args()
    rank, step = (int(part) for part in args.kill.split(":"))
    Path(args.root).mkdir(parents=True, exist_ok=True)

    seed_everything(0)
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target))
    strategy = DecentralizedStrategy(
        topology="ring",
        on_peer_failure="continue",  # the survivors go on without a lost worker
        rejoin=True,  # and a lost worker started again rejoins them
        timeout=timedelta(seconds=30),  # how long a silent peer is waited for
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # the launcher's --nproc-per-node
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=[KillOnce(rank, step, Path(args.root, f"killed-{rank}"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Digits(args.step_time), DataLoader(data, batch_size=32, shuffle=True))
    survived = ", ".join(
        f"{type(d).__name__} at step {d.step} (members {list(d.members)})" for d in strategy.failures_survived
    )
    ended = f"worker {os.environ['RANK']}: ended at step {trainer.global_step} among {trainer.world_size}; {survived}\n"
    print(ended, end="", flush=True)  # one write with its newline: the workers share the terminal


if __name__ == "__main__":
    main()
