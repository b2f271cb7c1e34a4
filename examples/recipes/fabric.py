"""Lightning Fabric: your own loop, decentralized, with `Fabric(strategy="dpsgd")`; x̄ evaluated every epoch; a
checkpoint that a second run resumes from (the data order included).

From the repository root (Fabric starts the other workers by running this module again)::

    python -m examples.recipes.fabric                  # 3 epochs on 2 CPU workers
    python -m examples.recipes.fabric --epochs 5       # again: resumes after epoch 3, trains epochs 3 and 4

The whole update rule runs inside `optimizer.step()` (docs/fabric.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

import lightning_decentral  # noqa: F401  (registers "dpsgd" and "decentlam" with Fabric too)
from examples.digits import DigitsDataModule
from lightning_decentral.fabric import DataOrder, consensus_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="train until this many epochs are done")
    parser.add_argument("--devices", type=int, default=2, help="CPU worker processes")
    parser.add_argument("--root", default="logs/recipes/fabric", help="where last.ckpt goes")
    args = parser.parse_args()

    fabric = Fabric(strategy="dpsgd", accelerator="cpu", devices=args.devices)  # or "decentlam"
    fabric.launch()
    fabric.seed_everything(0)  # every rank: the same initial model
    data = DigitsDataModule()
    data.setup("fit")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)  # the module itself: never wrapped in DDP
    loader = fabric.setup_dataloaders(DataLoader(data.train_set, batch_size=32, shuffle=True))  # a shard per rank
    images, labels = (torch.stack(t) for t in zip(*data.val_set))

    order = DataOrder(loader)  # the epoch count, so that a resumed run draws the orders the saved one would have
    state = {"model": model, "optimizer": optimizer, "data": order}
    checkpoint = Path(args.root, "last.ckpt")
    if checkpoint.exists():
        fabric.load(checkpoint, state)  # every replica its own state, from its shard
        fabric.print(f"resumed after epoch {order.epoch - 1} (step {fabric.strategy.step})")
    for epoch in range(order.epoch, args.epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()  # the update rule: U, then mix with the neighbours
            optimizer.zero_grad()
        with fabric.strategy.averaged_model(), torch.no_grad():  # every rank, between steps: x̄ in the model
            accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
        distance = consensus_metrics(fabric.strategy)["consensus/distance"]
        fabric.print(
            f"epoch {epoch}: step {fabric.strategy.step}, train loss {loss.item():.4f}, val_acc of x̄ {accuracy:.4f}, "
            f"consensus distance {distance:.2e}"
        )
        fabric.save(checkpoint, state)  # x̄ in the file, a shard per rank beside it


if __name__ == "__main__":
    main()
