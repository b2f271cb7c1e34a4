"""The Trainer's executor: [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy] (`strategy.py`), over
[`ReplicaStrategy`][lightning_decentral.trainer.replicated.ReplicaStrategy], Lightning's `DDPStrategy` without
the wrapper (`replicated.py`)."""

from lightning_decentral.trainer.replicated import ReplicaStrategy
from lightning_decentral.trainer.strategy import DecentralizedStrategy

__all__ = ["DecentralizedStrategy", "ReplicaStrategy"]
