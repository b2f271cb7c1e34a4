"""A training script for tests/test_survivors.py to run under `lightning-decentral-launch`: `--steps` steps on a ring
with `on_peer_failure="continue"` and `--min-workers`; `--deaths 0:10,1:20` kills rank 0 when step 10 starts, then
rank 1 at step 20. Each survivor writes its final replica and what it saw to `<out>/rank-<first rank>.pt`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `tests` is importable

import torch

from tests import survival_workers as workers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deaths", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--min-workers", type=int, required=True)
    args = parser.parse_args()
    deaths = {int(rank): int(step) for rank, step in (item.split(":") for item in args.deaths.split(","))}
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    result = workers.survive(rank, world_size, args.out, deaths=deaths, steps=args.steps, min_workers=args.min_workers)
    torch.save(result, f"{args.out}/rank-{rank}.pt")


if __name__ == "__main__":
    main()
