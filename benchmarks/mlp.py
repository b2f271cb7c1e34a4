"""The model the step-time benchmarks train (its widths: ``harness.FULL_WIDTHS``), each rank's data, the digits
data of ``simulate.py`` and ``gpu.py``, a step clock, and a Trainer that logs, checkpoints and prints nothing."""

from __future__ import annotations

import itertools
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build_mlp(widths: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class MLP(pl.LightningModule):
    """The benchmarked model: ``build_mlp(widths)``, cross-entropy, SGD with momentum."""

    def __init__(self, widths: tuple[int, ...], lr: float, momentum: float) -> None:
        super().__init__()
        torch.manual_seed(0)  # same start everywhere (the strategies broadcast rank 0's anyway)
        self.net = build_mlp(widths)
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def make_loader(rank: int, widths: tuple[int, ...], batch_size: int, batches: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard, in memory
    x = torch.randn(batch_size * batches, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (batch_size * batches,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False, num_workers=0)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (1797 samples, 64 features, 10 classes) as float32 features, standardized per feature (a
    constant feature stays 0), and labels."""
    from sklearn.datasets import load_digits  # scikit-learn: only these benchmarks need it

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    std = x.std(0, unbiased=False)
    x = (x - x.mean(0)) / torch.where(std > 0, std, torch.ones_like(std))
    return x, torch.tensor(y, dtype=torch.long)


def digits_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> DataLoader:
    """``(x, y)`` in shuffled batches of ``batch_size``, the last partial one dropped."""
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0)


class StepClock(pl.Callback):
    """``perf_counter()`` at every batch start and end."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())


def quiet_trainer(strategy: Any, max_steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A CPU ``Trainer`` without logger, checkpoints (unless ``enable_checkpointing=True``), progress bar or model
    summary."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(strategy=strategy, max_steps=max_steps, callbacks=callbacks, **{**settings, **kwargs})
