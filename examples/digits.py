"""Quickstart: a small CNN on scikit-learn's bundled digits, trained decentralized on 4 CPU workers.

Run from the repository root (the configs name these classes as ``examples.digits.*``)::

    lightning-decentral fit --config examples/configs/digits_dpsgd.yaml      # ring D-PSGD, 4 workers
    lightning-decentral fit --config examples/configs/digits_decentlam.yaml  # DecentLaM
    lightning-decentral fit --config examples/configs/digits_ddp.yaml        # the all-reduce baseline
    lightning-decentral fit --config examples/configs/digits_dpsgd.yaml \
        --trainer.strategy.init_args.topology exponential                     # any topology name

Offline: the digits (1,797 8×8 images) ship with scikit-learn. Each worker trains its own
replica on its shard and averages it with its ring neighbours only; the accuracy printed at
the end is that of the averaged model ``x̄``.
"""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning_decentral import DirichletSampler


class DigitsDataModule(LightningDataModule):
    """scikit-learn's 8×8 digits as 1×8×8 float images in [0, 1]; a fixed 80/20 split.

    `dirichlet_alpha`: give each worker its own label-skewed shard of the training set
    ([`DirichletSampler`][lightning_decentral.data.DirichletSampler], seeded by `seed`; `.inf` in YAML is
    the IID split); `None` (the default): Lightning's `DistributedSampler` over the shuffled set.
    """

    def __init__(
        self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0, dirichlet_alpha: float | None = None
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.dirichlet_alpha = dirichlet_alpha

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        dataset = TensorDataset(images, labels)
        n_val = int(len(dataset) * self.val_fraction)
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set = random_split(dataset, [len(dataset) - n_val, n_val], generator=generator)

    def train_dataloader(self) -> DataLoader:
        if self.dirichlet_alpha is None:
            return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)
        labels = self.train_set.dataset.tensors[1][self.train_set.indices]
        sampler = DirichletSampler(self.train_set, labels, self.dirichlet_alpha, seed=self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    test_dataloader = predict_dataloader = val_dataloader


class DigitsCNN(LightningModule):
    """Two 3×3 convolutions, a max-pool and two linear layers: about 40k parameters."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.hparams.lr,
            momentum=self.hparams.momentum,
            weight_decay=self.hparams.weight_decay,
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
