"""Which samples each worker trains on, under a DirichletSampler: on processes and in the simulation."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy, DirichletSampler, SimulatedDecentralizedStrategy

SAMPLES, CLASSES, ALPHA, SEED, BATCH, EPOCHS = 120, 4, 0.3, 11, 5, 2
LABELS = torch.arange(SAMPLES) % CLASSES


def dataset() -> TensorDataset:
    """Sample `i` is `(float(i), i)`: a batch tells which samples it holds."""
    return TensorDataset(torch.arange(SAMPLES, dtype=torch.float32)[:, None], torch.arange(SAMPLES))


def expected(rank: int, world_size: int) -> list[int]:
    """The indices rank `rank` of `world_size` draws over `EPOCHS` epochs, from the sampler itself."""
    sampler = DirichletSampler(dataset(), LABELS, ALPHA, num_replicas=world_size, rank=rank, seed=SEED)
    seen = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        seen += list(sampler)
    return seen


class Recorder(pl.LightningModule):
    """Records the sample indices of every training batch; builds its DataLoader with a DirichletSampler
    in `train_dataloader` (after the processes joined), rank and world size from torch.distributed."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, index = batch
        self.seen += index.tolist()
        return self.layer(x).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        data = dataset()
        return DataLoader(data, batch_size=BATCH, sampler=DirichletSampler(data, LABELS, ALPHA, seed=SEED))


def _trainer(strategy: Any, devices: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit_processes(rank: int, world_size: int) -> dict[str, Any]:
    """This rank's samples under DecentralizedStrategy, and the error of a sampler built before the group."""
    early = DirichletSampler(dataset(), LABELS, ALPHA, seed=SEED)  # no process group yet: rank 0 of 1
    model = Recorder()
    _trainer(DecentralizedStrategy(), world_size).fit(model)
    try:
        iter(early)
        error = ""
    except ValueError as caught:
        error = str(caught)
    return {"seen": model.seen, "error": error}


def fit_simulated(workers: int) -> list[list[int]]:
    """Each simulated worker's samples."""
    strategy = SimulatedDecentralizedStrategy(workers=workers)
    _trainer(strategy, 1).fit(Recorder())
    return [module.seen for module in strategy.worker_modules()]
