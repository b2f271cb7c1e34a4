"""A script for tests/test_survivors.py, run as a user runs one (`python lightning_launcher_script.py OUT`):
`Trainer(devices=3)` with `on_peer_failure="continue"`, so that Lightning's own launcher starts ranks 1 and 2. Each
rank writes its PID to `OUT/pid-<rank>` when step 2 starts, then trains on; one that finishes prints so."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `tests` is importable

from lightning.pytorch import Callback

from lightning_decentral import DecentralizedStrategy
from tests.models import Regression, init_seed, loader
from tests.workers import trainer_for


class WritePid(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 2:
            Path(self.out, f"pid-{trainer.global_rank}").write_text(str(os.getpid()))


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning sets it in the processes it starts
    strategy = DecentralizedStrategy(on_peer_failure="continue", timeout=timedelta(seconds=60))
    trainer = trainer_for(3, strategy, max_steps=20000, callbacks=[WritePid(out)])
    trainer.fit(Regression(seed=init_seed(rank), lr=0.05, momentum=0.9), loader(rank, 80, 8))
    print(f"rank {trainer.global_rank} finished {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
