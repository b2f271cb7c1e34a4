"""Checkpoints on a filesystem of their own: a full disk, and a writer killed midway.

Run as ``python -m tests.filesystems <scenario> <directory>`` with ``<directory>`` a small filesystem of its own
(tests/test_atomic_files.py mounts a tmpfs there in a private mount namespace), other than the system temporary
directory, as scratch space or NFS is on a cluster. Prints one JSON line: what the scenario saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import SimulatedDecentralizedStrategy
from lightning_decentral.checkpoint import META_KEY, read_shard, shard_path

WORKERS = 2


class Wide(pl.LightningModule):
    """One linear layer of `width` x 64 weights: a checkpoint of about `width` / 4 kB per copy of the model."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(64, width, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _fit(steps: int, width: int, callbacks: list[pl.Callback]) -> None:
    trainer = pl.Trainer(
        strategy=SimulatedDecentralizedStrategy(workers=WORKERS, vectorize=False),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(4 * steps * WORKERS, 64)), batch_size=4)
    trainer.fit(Wide(width), train_dataloaders=data)


def whole(path: Path) -> dict[str, Any]:
    """The step of checkpoint `path` and whether every shard it names loads; `{"error": ...}` if the file does not."""
    try:
        checkpoint = torch.load(path, weights_only=True)
    except Exception as error:  # a damaged file
        return {
            "error": f"{type(error).__name__}: {error}"[:200],
            "bytes": path.stat().st_size if path.exists() else None,
        }
    meta = checkpoint[META_KEY]
    shards = [
        read_shard(shard_path(str(path), rank, meta["world_size"], meta["save_id"]))
        for rank in range(meta["world_size"])
    ]
    return {"step": checkpoint["global_step"], "shards": [shard["strategy"]["step"] for shard in shards]}


def _free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


class FillTheDiskBeforeTheSecondSave(pl.Callback):
    """Saves `last.ckpt` at step 1, weights only; at step 2 fills the disk so that the shards of a full save (twice
    the size: weights and momentum) fit and its file does not, even once the previous file's space is freed; then
    saves again and records the error."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.error = directory, ""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        path = self.directory / "last.ckpt"
        if trainer.global_step == 1:
            trainer.save_checkpoint(path, weights_only=True)
        elif trainer.global_step == 2:
            shards = sum(p.stat().st_size for p in Path(f"{path}.shards").iterdir())
            room = 2 * shards + 2**16 + path.stat().st_size // 2  # this save's shards, and a quarter of its file
            (self.directory / "filler").write_bytes(b"\0" * max(0, _free_bytes(self.directory) - room))
            try:
                trainer.save_checkpoint(path)
            except OSError as error:
                self.error = f"{type(error).__name__}: {error}"
            (self.directory / "filler").unlink()


def full_disk(directory: Path) -> dict[str, Any]:
    """A save on a full disk: the previous `last.ckpt` and its shards must stay whole."""
    callback = FillTheDiskBeforeTheSecondSave(directory)
    _fit(3, width=2048, callbacks=[callback])
    return {"error": callback.error, "last": whole(directory / "last.ckpt"), "files": sorted(os.listdir(directory))}


class SaveEveryStep(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)
        print(f"saved {trainer.global_step}", flush=True)


def save_every_step(directory: Path) -> None:
    """The writer of `killed_writer`: `last.ckpt` of about 32 MB, over and over."""
    _fit(1000, width=2**17, callbacks=[SaveEveryStep(directory / "last.ckpt")])


def killed_writer(directory: Path) -> dict[str, Any]:
    """Kill a writer (`kill -9`) the moment it starts writing the file of its second save: `last.ckpt` must stay a
    whole checkpoint, the first one or the second."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.filesystems", "save_every_step", str(directory)],
        stdout=subprocess.PIPE,
        text=True,
    )
    path = directory / "last.ckpt"
    deadline = time.monotonic() + 120
    assert writer.stdout is not None
    while writer.stdout.readline().strip() != "saved 1":  # the first save is complete
        assert time.monotonic() < deadline and writer.poll() is None, "the writer never saved"
    first = path.stat()
    started = lambda: (  # noqa: E731  # the file is being written: a temporary file beside it, or the file itself changed
        any(
            p.name.startswith("last.ckpt") and p.name != "last.ckpt" and not p.name.endswith(".shards")
            for p in directory.iterdir()
        )
        or (path.stat().st_mtime_ns, path.stat().st_ino, path.stat().st_size)
        != (first.st_mtime_ns, first.st_ino, first.st_size)
    )
    while not started():
        assert time.monotonic() < deadline and writer.poll() is None, "the writer never wrote the file again"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    return {"last": whole(path), "files": sorted(os.listdir(directory))}


if __name__ == "__main__":
    scenario, target = sys.argv[1], Path(sys.argv[2])
    result = globals()[scenario](target)
    if result is not None:
        print(json.dumps(result), flush=True)
