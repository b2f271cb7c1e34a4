"""Resuming: save every few steps, and start every run with `ckpt_path="last"`; run it again and it goes on.

From the repository root (Lightning starts the other workers by running this module again)::

    python -m examples.recipes.resume --max-steps 20      # trains steps 0-19, saves every 5 steps
    python -m examples.recipes.resume --max-steps 40      # resumes at step 20, trains to 40

Every replica resumes its own state (its shard beside the checkpoint), bit for bit at the same number of workers;
with another number, every replica starts from x̄. `resume="newest_complete"` falls back to the newest checkpoint
every rank can read whole (docs/reliability/restarts.md). The same script under `torchrun --max-restarts 3` restarts
after a failure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.digits import DigitsCNN, DigitsDataModule
from lightning_decentral import DecentralizedStrategy


class FirstStep(Callback):
    """Remembers the step training starts at (0, or the resumed checkpoint's)."""

    step = None

    def on_train_start(self, trainer: Trainer, pl_module: object) -> None:
        self.step = trainer.global_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="save every this many steps")
    parser.add_argument("--devices", type=int, default=2, help="CPU worker processes")
    parser.add_argument("--root", default="logs/recipes/resume", help="checkpoints go to <root>/checkpoints")
    args = parser.parse_args()

    seed_everything(0)
    first = FirstStep()
    checkpoints = ModelCheckpoint(  # a directory every run finds again (the logger's changes with every run)
        dirpath=Path(args.root, "checkpoints"), every_n_train_steps=args.every, save_last=True, save_top_k=-1
    )
    trainer = Trainer(
        strategy=DecentralizedStrategy(topology="ring", resume="newest_complete"),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=[checkpoints, first],
        default_root_dir=args.root,
        enable_progress_bar=False,
    )
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(), ckpt_path="last")  # none yet: starts at step 0
    if trainer.is_global_zero:
        print(f"started at step {first.step}, ended at step {trainer.global_step}; last: {checkpoints.last_model_path}")


if __name__ == "__main__":
    main()
