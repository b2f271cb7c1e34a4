"""A fault plan: ranks of a run kill themselves at the steps it names, once each, to test a job's fault tolerance
([Rejoining](../reliability/rejoining.md)) before a real failure does.

"Once" is remembered in the job's store at `MASTER_ADDR:MASTER_PORT` (a key per rank and step, added to before the
kill), so a process started again that begins the same step again (torchrun restarting every worker from the last
checkpoint) is spared; the store must outlive the rank, as torchrun's agent's and `lightning-decentral-launch`'s do.
Without a process group (one process) nothing remembers, and nothing starts the process again either.
"""

from __future__ import annotations

import os
import signal as signals
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_decentral.membership.store import store_client

KEY = "lightning_decentral/faults"  # the store's keys of the kills done: KEY/<rank>/<step>


class FaultPlan(Callback):
    """Rank `r` (its rank when the run started: a failure renumbers the survivors) sends itself `signal` when
    optimizer step `k` begins, for every `r` in `kill[k]`, once in the whole job.

    ```python
    trainer = Trainer(
        strategy=DecentralizedStrategy(on_peer_failure="continue", rejoin=True),
        callbacks=[FaultPlan(kill={200: [1], 400: [2, 3]})],
    )  # run under lightning-decentral-launch --max-restarts 2: ranks 1, 2 and 3 die and rejoin
    ```

    Examples:
        >>> FaultPlan(kill={200: [1], 400: [2, 3]}).kill
        {200: (1,), 400: (2, 3)}
        >>> FaultPlan(kill={-1: [0]})
        Traceback (most recent call last):
        ...
        ValueError: FaultPlan(kill=...) maps optimizer steps (integers >= 0) to lists of ranks (integers >= 0),
        got {-1: [0]}.

    Args:
        kill: `{step: [ranks]}`.
        signal: what each rank sends itself (default `SIGKILL`, a death without a word; `SIGTERM` asks Lightning to
            stop).
    """

    def __init__(self, kill: Mapping[int, Sequence[int]], signal: int = signals.SIGKILL) -> None:
        def natural(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        if not isinstance(kill, Mapping) or not all(
            natural(step) and isinstance(ranks, Sequence) and all(natural(r) for r in ranks)
            for step, ranks in kill.items()
        ):
            raise ValueError(
                "FaultPlan(kill=...) maps optimizer steps (integers >= 0) to lists of ranks (integers >= 0), got "
                f"{kill!r}."
            )
        self.kill = {step: tuple(ranks) for step, ranks in kill.items()}
        self.signal = signal

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Before the run: every rank named is one of the run's at its start (a failure or a rejoin renumbers and
        counts the ranks anew, the plan's ranks stay those of the start)."""
        named = sorted({rank for ranks in self.kill.values() for rank in ranks})
        size = getattr(trainer.strategy, "start_size", trainer.world_size)
        if named and named[-1] >= size:
            raise ValueError(
                f"FaultPlan(kill=...) names ranks {named}, but the run has {size} (0 to {size - 1}): name ranks of the "
                "run as it starts."
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """When step `k` begins: this rank dies if `kill[k]` names it and it has not died there before."""
        step = trainer.global_step
        rank = getattr(trainer.strategy, "first_rank", trainer.global_rank)
        if rank in self.kill.get(step, ()) and _first_time(rank, step):
            os.kill(os.getpid(), self.signal)


def _first_time(rank: int, step: int) -> bool:
    """Whether `rank` has not been killed at `step` in this job before (now it has)."""
    if not dist.is_initialized():
        return True
    return store_client(timedelta(seconds=30)).add(f"{KEY}/{rank}/{step}", 1) == 1
