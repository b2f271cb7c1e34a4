"""D-PSGD in place of DDP: the same LightningModule and Trainer, `strategy="dpsgd"` instead of `"ddp"`.

From the repository root (Lightning starts the other workers by running this module again)::

    python -m examples.recipes.dpsgd                                   # D-PSGD on a ring, 4 CPU workers
    python -m examples.recipes.dpsgd --strategy ddp                    # Lightning's all-reduce, to compare
    python -m examples.recipes.dpsgd --strategy decentlam              # DecentLaM
    python -m examples.recipes.dpsgd --devices 2 --max-steps 20        # a quick try

Validation runs on the average of the replicas, x̄, and the checkpoint holds x̄.
"""

from __future__ import annotations

import argparse

from lightning.pytorch import Trainer, seed_everything

import lightning_decentral  # noqa: F401  (registers "dpsgd" and "decentlam")
from examples.digits import DigitsCNN, DigitsDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="dpsgd", help="dpsgd, decentlam, or Lightning's ddp")
    parser.add_argument("--devices", type=int, default=4, help="CPU worker processes")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop earlier (-1: after --max-epochs)")
    parser.add_argument("--root", default="logs/recipes/dpsgd", help="logs and checkpoints")
    args = parser.parse_args()

    seed_everything(0)  # every worker starts from the same model
    trainer = Trainer(
        strategy=args.strategy,  # the one change: "ddp" -> "dpsgd"
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir=args.root,
        enable_progress_bar=False,
    )
    model, data = DigitsCNN(), DigitsDataModule()
    trainer.fit(model, datamodule=data)
    (metrics,) = trainer.validate(model, datamodule=data, verbose=False)  # on x̄ (eval_on="average")
    if trainer.is_global_zero:
        print(
            f"{args.strategy}: {trainer.global_step} steps on {trainer.world_size} workers; "
            f"val_acc = {metrics['val_acc']:.4f}, val_loss = {metrics['val_loss']:.4f}; "
            f"checkpoint: {trainer.checkpoint_callback.best_model_path}"
        )


if __name__ == "__main__":
    main()
