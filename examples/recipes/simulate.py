"""The simulation: `n` decentralized workers in one process, with the monitors logged to CSV.

The run `DecentralizedStrategy` makes on `n` processes, replica for replica, on one CPU (docs/simulation.md). From the
repository root::

    python -m examples.recipes.simulate                                  # 16 workers on a ring, 5 epochs
    python -m examples.recipes.simulate --workers 64 --topology exponential
    python -m examples.recipes.simulate --max-steps 10                   # a quick try

Each run logs to `<root>/<topology>-<workers>/metrics.csv`: the loss, the accuracy of x̄, the consensus distance Ξ and
the effective learning rate; `python -m lightning_decentral.plot DIR [DIR ...]` draws them (docs/monitoring.md).
"""

from __future__ import annotations

import argparse

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from examples.digits import DigitsCNN, DigitsDataModule
from lightning_decentral import SimulatedDecentralizedStrategy
from lightning_decentral.callbacks import ConsensusDistance, EffectiveLearningRate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--topology", default="ring", help="ring, torus, exponential, one_peer_exponential, complete")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop earlier (-1: after --max-epochs)")
    parser.add_argument("--root", default="logs/recipes/simulate", help="one CSV log per run under it")
    args = parser.parse_args()

    seed_everything(0)
    name = f"{args.topology}-{args.workers}"
    trainer = Trainer(
        strategy=SimulatedDecentralizedStrategy(workers=args.workers, topology=args.topology),
        accelerator="cpu",
        devices=1,  # one process: the workers live inside it
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        logger=CSVLogger(args.root, name=name, version=""),
        log_every_n_steps=1,
        callbacks=[ConsensusDistance(every_n_steps=1), EffectiveLearningRate(every_n_steps=5)],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model, data = DigitsCNN(), DigitsDataModule()  # batch_size 32 per worker, as on processes
    trainer.fit(model, datamodule=data)
    relative = float(trainer.callback_metrics["consensus/relative"])  # Ξ/‖x̄‖ after the last step
    (metrics,) = trainer.validate(model, datamodule=data, verbose=False)  # on x̄
    print(
        f"{args.workers} simulated workers, {args.topology}: {trainer.global_step} steps; "
        f"val_acc of x̄ = {metrics['val_acc']:.4f}; "
        f"Ξ/‖x̄‖ = {relative:.2e}; log: {trainer.logger.log_dir}"
    )


if __name__ == "__main__":
    main()
