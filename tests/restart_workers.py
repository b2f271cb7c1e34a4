"""Workers of tests/test_restart.py: saves in the background, the newest complete checkpoint, a changed world size,
and the job torchrun launches (`python tests/restart_workers.py ...` under torchrun, see `main`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__":  # under torchrun: `tests` is importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy
from lightning_decentral import checkpoint as checkpoint_io
from tests.models import Regression, flat, init_seed, rank_data
from tests.workers import trainer_for

BATCHES = 4  # per epoch
BATCH = 8
EVERY = 2  # a checkpoint every EVERY steps
MOMENTUM_SGD = {"lr": 0.05, "momentum": 0.9}


class Pause(Callback):
    """At the start of step `step`, on rank `rank` only: write this process's pid to `pid_file`, then wait there
    (to be killed; a bound of 120 s)."""

    def __init__(self, rank: int, step: int, pid_file: str) -> None:
        self.rank, self.step, self.pid_file = rank, step, pid_file

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.pid_file).write_text(str(os.getpid()))
            time.sleep(120)


def fit(
    rank: int,
    world_size: int,
    directory: str,
    max_steps: int,
    ckpt_path: Optional[str] = None,
    background: bool = False,
    top_k: int = -1,
    strategy: Optional[dict] = None,
    callbacks: Optional[list] = None,
) -> dict[str, Any]:
    """Train the regression of tests/models.py (momentum SGD, shuffled data: the order of each epoch comes from the
    RNG the shards restore) with a checkpoint every `EVERY` steps in `directory` and `last.ckpt`; return this rank's
    replica at the start and the end, the step it started from, and the warnings."""
    torch.manual_seed(0)  # the shuffling's generator, the same in every run
    model = Regression(seed=init_seed(rank), **MOMENTUM_SGD)
    saves = ModelCheckpoint(directory, every_n_train_steps=EVERY, save_top_k=top_k, save_last=True)
    trainer = trainer_for(
        world_size, DecentralizedStrategy(**(strategy or {})), max_steps=max_steps, enable_checkpointing=True,
        callbacks=[saves, *(callbacks or [])], plugins=[AsyncCheckpointIO()] if background else None,
    )
    train = DataLoader(TensorDataset(*rank_data(rank, BATCHES * BATCH)), batch_size=BATCH, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, ckpt_path=ckpt_path)
    return {
        "start": model.train_start_params,
        "end": flat(model),
        "warnings": [str(w.message) for w in caught if "Resuming from" in str(w.message)],
    }


def background_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The same run saving synchronously and in the background; then a resume from a background save."""
    steps = 2 * BATCHES
    out = {mode: fit(rank, world_size, f"{root}/{mode}", steps, background=mode == "background") for mode in ("sync", "background")}
    start = f"{root}/background/epoch=0-step={BATCHES}.ckpt"  # an epoch boundary
    resumed = fit(rank, world_size, f"{root}/resumed", steps, ckpt_path=start, background=True)
    out["resumed"] = resumed
    return out


class DiskFullFrom(Callback):
    """Rank `rank` cannot write its shard of a save at step `step` or later."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if trainer.global_rank == self.rank:
            write_shard = checkpoint_io.write_shard

            def full(shard: dict[str, Any], path: str) -> None:
                if shard["strategy"]["step"] >= self.step:
                    raise OSError("No space left on device (simulated)")
                write_shard(shard, path)

            checkpoint_io.write_shard = full


def failed_background_save(rank: int, world_size: int, root: str) -> str:
    """Rank 1 cannot write its shard of the second save: every rank raises, and the first save, which
    `ModelCheckpoint(save_top_k=1)` removes right after asking for the second, stays."""
    try:
        fit(rank, world_size, root, 3 * EVERY, background=True, top_k=1, callbacks=[DiskFullFrom(1, 2 * EVERY)])
        return "no error"
    except (OSError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
