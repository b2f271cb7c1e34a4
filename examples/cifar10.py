"""ResNet-20 on CIFAR-10, set up like the experiments of the consensus-control paper.

Kong, Lin, Koloskova, Jaggi, Stich, *Consensus Control for Decentralized Deep Learning*
(ICML 2021): ResNet-20, standard augmentation (random crop with 4-pixel padding, horizontal
flip), momentum SGD (0.9, Nesterov, weight decay 1e-4), 300 epochs, a learning rate scaled
linearly with the total batch (0.1 per 128 samples, Goyal et al. 2017) reached after a 5-epoch
linear warm-up and divided by 10 at 50 % and 75 % of training. From the repository root::

    lightning-decentral fit --config examples/configs/cifar10_resnet20_dpsgd.yaml
    lightning-decentral fit --config examples/configs/cifar10_resnet20_decentlam.yaml --trainer.num_nodes 4

The first run downloads CIFAR-10 (170 MB) with torchvision into ``data_dir``.
"""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class CIFAR10DataModule(LightningDataModule):
    """CIFAR-10 from torchvision: 50k training images (augmented), the 10k test images for validation.

    Args:
        data_dir: where the dataset is (or is downloaded to).
        batch_size: samples per worker per step; the total batch is ``batch_size x workers``.
        num_workers: data-loading processes per worker.
        download: download the dataset if it is not in ``data_dir`` (on each node's local rank 0).
    """

    def __init__(
        self, data_dir: str = "data/cifar10", batch_size: int = 32, num_workers: int = 4, download: bool = True
    ):
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.download = download

    def prepare_data(self) -> None:
        from torchvision.datasets import CIFAR10

        for train in (True, False):
            CIFAR10(self.data_dir, train=train, download=self.download)

    def setup(self, stage: str) -> None:
        from torchvision import transforms
        from torchvision.datasets import CIFAR10

        normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
        augment = transforms.Compose(
            [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
        )
        plain = transforms.Compose([transforms.ToTensor(), normalize])
        self.train_set = CIFAR10(self.data_dir, train=True, transform=augment)
        self.val_set = CIFAR10(self.data_dir, train=False, transform=plain)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=True,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers, pin_memory=True)

    test_dataloader = val_dataloader


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm; the shortcut halves the resolution and zero-pads the channels
    where the shape changes (He et al. 2016, option A)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.stride = stride
        self.pad = channels_out - channels_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


def resnet20(num_classes: int = 10) -> nn.Sequential:
    """ResNet-20 for 32x32 images: a 3x3 stem, three stages of three basic blocks (16, 32, 64
    channels), global average pooling, one linear layer; 0.27M parameters."""
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    channels = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(_BasicBlock(channels, width, stride=2 if stage > 0 and block == 0 else 1))
            channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class ResNet20(LightningModule):
    """ResNet-20 trained with momentum SGD under a warm-up + step-decay schedule.

    The peak learning rate is ``lr x (workers x per-worker batch) / lr_batch``. The first
    ``warmup_epochs`` ramp it linearly from one worker's share (``peak / workers``); afterwards
    it is multiplied by ``gamma`` at each fraction ``milestones`` of the training steps.

    Args:
        lr: the learning rate for ``lr_batch`` samples per step.
        lr_batch: the batch ``lr`` is given for.
        momentum, nesterov, weight_decay: the SGD settings.
        warmup_epochs: epochs of linear warm-up.
        milestones: fractions of all training steps at which the learning rate drops.
        gamma: the factor of each drop.
    """

    def __init__(
        self,
        lr: float = 0.1,
        lr_batch: int = 128,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 1e-4,
        warmup_epochs: int = 5,
        milestones: tuple[float, ...] = (0.5, 0.75),
        gamma: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = resnet20()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    test_step = validation_step

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        trainer = self.trainer
        total_steps = int(trainer.estimated_stepping_batches)  # this also loads the training data
        workers = trainer.world_size
        peak = hp.lr * workers * trainer.train_dataloader.batch_size / hp.lr_batch
        warmup_steps = hp.warmup_epochs * trainer.num_training_batches // trainer.accumulate_grad_batches
        drops = [int(fraction * total_steps) for fraction in hp.milestones]

        def factor(step: int) -> float:
            if step < warmup_steps:
                return (1 + (workers - 1) * step / warmup_steps) / workers
            return hp.gamma ** sum(step >= drop for drop in drops)

        optimizer = torch.optim.SGD(
            self.parameters(), lr=peak, momentum=hp.momentum, nesterov=hp.nesterov, weight_decay=hp.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
