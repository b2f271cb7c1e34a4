"""Soak test: thousands of steps of ``DecentralizedStrategy``; memory must stay flat and steps must not slow down.

::

    python benchmarks/soak.py                                   # 4 processes, awc/atc/decentlam, 3000 steps each
    python benchmarks/soak.py --steps 12 --window 4 --processes 2 --methods awc --out soak.json   # a smoke run

Each method runs ``--steps`` optimizer steps of a tiny MLP on ``--processes`` CPU processes over gloo
(forked by ``harness.run_ranks``, with the environment Lightning's launcher gives its children),
with a ``ModelCheckpoint`` writing (and, top-1, removing) a checkpoint and its shards every
``--checkpoint-every`` steps, so the save and remove paths run hundreds of times too. At the end
of every window of ``--window`` steps each rank records its resident set size
(``/proc/self/statm``), the number of objects the garbage collector tracks, and the wall time of
the window. The report gives, per window, the largest RSS
over ranks, rank 0's object count and the slowest rank's mean step; then the growth from the
second window (the first one warms up allocators and caches) to the last, and the ratio of the last
window's step time to the second's.

First, on one thread, it times the NaN/Inf check the gossip engine runs before every exchange
(``lightning_decentral.mixing.raise_if_not_finite``) on a float32 buffer of ``--check-elements``
(default: the 5,257,226 parameters of ``benchmarks/step_time.py``), against the addition of the gossip
correction, ``x <- x + (W x − x)``, that every AWC step already makes on the same buffer (median of 20
runs each).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.mixing import raise_if_not_finite

METHODS = {
    "awc": {},
    "atc": {"combine": "atc"},
    "decentlam": {"momentum": "decentlam"},
}


class _MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Probe(pl.Callback):
    """Every ``window`` steps: RSS, gc-tracked objects, and the window's wall time."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.records: list[dict[str, float]] = []
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.window:
            return
        now = time.perf_counter()
        gc.collect()
        self.records.append(
            {
                "step": trainer.global_step,
                "rss_mb": _rss_bytes() / 2**20,
                "objects": len(gc.get_objects()) - len(self.records),  # less this probe's own records
                "step_ms": (now - self._start) / self.window * 1e3,
            }
        )
        self._start = time.perf_counter()  # the probe's own cost stays out of the next window


def _train(method: str, args: argparse.Namespace, checkpoints: str, rank: int) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(1024, 32, generator=generator)
    data = DataLoader(TensorDataset(x, torch.sin(x[:, :8])), batch_size=16)
    probe = _Probe(args.window)
    trainer = pl.Trainer(
        strategy=DecentralizedStrategy(**METHODS[method]),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[probe, pl.callbacks.ModelCheckpoint(checkpoints, every_n_train_steps=args.checkpoint_every)],
    )
    trainer.fit(_MLP(), data)
    return probe.records


def _run(method: str, args: argparse.Namespace) -> list[list[dict[str, float]]]:
    # one directory for all ranks, removed once every rank has exited (a rank's own temporary
    # directory would vanish under the others when it finished first)
    with tempfile.TemporaryDirectory() as checkpoints:
        work = functools.partial(_train, method, args, checkpoints)
        return harness.run_ranks(work, args.processes, timeout=args.timeout, one_node=True)


def _finite_check_cost(elements: int) -> dict[str, float]:
    """Median seconds of ``raise_if_not_finite`` and of ``x += correction`` on float32 buffers, on one thread."""
    torch.set_num_threads(1)
    buffer, correction = torch.randn(elements), torch.zeros(elements)

    def median_seconds(fn: Any) -> float:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    check = median_seconds(lambda: raise_if_not_finite([buffer], 0, 0))
    add = median_seconds(lambda: buffer.add_(correction))
    return {"elements": elements, "check_s": check, "add_s": add, "ratio_to_add": check / add}


def _summary(method: str, per_rank: list[list[dict[str, float]]]) -> dict[str, Any]:
    windows = [
        {
            "step": records[0]["step"],
            "rss_mb_max": max(r["rss_mb"] for r in records),
            "objects_rank0": records[0]["objects"],
            "step_ms_slowest": max(r["step_ms"] for r in records),
        }
        for records in zip(*per_rank)
    ]
    base, last = windows[1 if len(windows) > 2 else 0], windows[-1]
    return {
        "method": method,
        "windows": windows,
        "rss_growth_mb": last["rss_mb_max"] - base["rss_mb_max"],
        "objects_growth": last["objects_rank0"] - base["objects_rank0"],
        "step_time_ratio": last["step_ms_slowest"] / base["step_ms_slowest"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--window", type=int, default=250, help="steps per measurement window")
    parser.add_argument("--checkpoint-every", type=int, default=250, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {list(METHODS)}")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per method before giving up")
    parser.add_argument(
        "--check-elements", type=int, default=5_257_226, help="buffer size for the NaN/Inf check timing"
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    harness.exit_on_sigterm()
    cost = _finite_check_cost(args.check_elements)
    print(
        f"NaN/Inf check of {cost['elements']:,} float32: {cost['check_s'] * 1e3:.2f} ms; AWC's x += correction on "
        f"the same buffer: {cost['add_s'] * 1e3:.2f} ms (ratio {cost['ratio_to_add']:.2f})"
    )
    summaries = []
    for method in args.methods.split(","):
        summary = _summary(method, _run(method, args))
        summaries.append(summary)
        print(f"\n{method}: {args.processes} processes, {args.steps} steps")
        print(f"{'step':>6} {'max RSS (MiB)':>14} {'objects (rank 0)':>17} {'ms/step (slowest)':>18}")
        for w in summary["windows"]:
            print(f"{w['step']:>6} {w['rss_mb_max']:>14.1f} {w['objects_rank0']:>17} {w['step_ms_slowest']:>18.2f}")
        print(
            f"growth after the first window: RSS {summary['rss_growth_mb']:+.1f} MiB, objects "
            f"{summary['objects_growth']:+d}, step time x{summary['step_time_ratio']:.2f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "finite_check": cost, "methods": summaries},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
