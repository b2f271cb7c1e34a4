"""Stragglers: steps/s of every update rule against DDP in the same launch, with emulated compute and slow ranks;
and the accuracy bounded staleness costs, over seeds, in the simulation.

    python benchmarks/stragglers.py                      # 4 cases x 3 launches, 4 ranks, 100 steps of 20 ms each
    python benchmarks/stragglers.py --accuracy           # x̄'s digits accuracy over 5 seeds, s = 0, 1, 2 (simulation)
    python benchmarks/stragglers.py --drift              # how far stale gossip moves x̄ (pure averaging, no gradient)
    python benchmarks/stragglers.py --smoke              # 2 ranks, 6 steps of AWC s=1 and DDP; 1 epoch of s = 0, 1
    python benchmarks/stragglers.py --cases random_100 --repeats 1 --out table.md --out results.json

Throughput: 4 gloo ranks on loopback, started by ``harness.run_ranks``. Each rank's ``training_step`` sleeps its
emulated compute (``--compute-ms``, 20, plus what the case adds) before a small MLP's step on scikit-learn's digits
(its own ``DistributedSampler`` shard, 32 samples per step); the cases:

* ``none``: every rank 20 ms;
* ``rank0_40``: rank 0 always 40 ms;
* ``random_100``: at every step one rank, drawn from the launch's seed, takes 100 ms more;
* ``rank0_3x``: rank 0 three times slower (60 ms).

One launch runs, one after the other in the same four processes, DDP and every method of ``--methods``, each a
fresh ``Trainer(max_steps=--steps)``; a method's steps/s is ``(steps − warmup) / (t_end − t_warm)``, from the time the
slowest rank ended step ``warmup`` to the time the slowest rank ended its last step (``time.monotonic()``, one clock
for the processes of one machine), and its ratio is to DDP's in the same launch. The table gives the median over the
launches (``--repeats``, 3, seeds 0, 1, 2), and, from the first launch: *apart*, the most steps any rank had
completed more than another at any moment; *when the first finished*, the steps each rank had completed when the
first rank completed its last; *acc*, the digits validation accuracy of ``x̄`` (DDP: of its one model) after training.

Accuracy (``--accuracy``): ``SimulatedDecentralizedStrategy(workers=4, vectorize=True)`` on the digits, ring, AWC
and ATC, ``staleness`` 0, 1, 2 with ``delays=RandomDelays(seed)`` (each neighbour's replica ``d`` steps old, ``d``
uniform in ``0..s``, drawn per worker, neighbour and step: staler than the newest rule on processes), ``--epochs``
epochs, momentum SGD with a cosine schedule; mean and standard deviation of ``x̄``'s validation accuracy over
``--seeds`` seeds (model initialization, data order and delays).

Drift (``--drift``): pure gossip, no gradient, of rows ``x(0) ~ N(0, I)`` (``--ranks`` and 16 workers, 64 values
each) under ``DelayedMixing`` with ``RandomDelays(seed)``, 200 steps: the distance from the value the rows agree on
to ``x̄(0)``, relative to the initial spread ``sqrt((1/n) Σ_i ‖x_i(0) − x̄(0)‖²)``; mean and largest over the seeds.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import statistics
import time
from datetime import datetime, timezone
from typing import Any

import harness

CASES = ("none", "rank0_40", "random_100", "rank0_3x")
METHODS = {
    "ring_awc": {"topology": "ring"},
    "ring_atc": {"topology": "ring", "combine": "atc"},
    "one_peer_awc": {"topology": "one_peer_exponential"},
    "decentlam_ring": {"topology": "ring", "momentum": "decentlam"},
    "ring_awc_s1": {"topology": "ring", "staleness": 1},
    "ring_awc_s2": {"topology": "ring", "staleness": 2},
    "ring_atc_s1": {"topology": "ring", "combine": "atc", "staleness": 1},
    "ring_atc_s2": {"topology": "ring", "combine": "atc", "staleness": 2},
}
ACCURACY_RULES = (("awc", 0), ("awc", 1), ("awc", 2), ("atc", 0), ("atc", 1), ("atc", 2))
WIDTHS = (64, 64, 10)


def compute_ms(case: str, rank: int, step: int, seed: int, base: float, ranks: int) -> float:
    """The emulated compute of `rank` at `step` in `case` (the same on every rank: the random straggler is a hash).

    Examples:
        >>> [compute_ms("rank0_3x", r, 0, 0, 20.0, 4) for r in range(4)], compute_ms("rank0_40", 0, 7, 0, 20.0, 4)
        ([60.0, 20.0, 20.0, 20.0], 40.0)
    """
    if case == "rank0_40":
        return 40.0 if rank == 0 else base
    if case == "rank0_3x":
        return 3 * base if rank == 0 else base
    if case == "random_100":
        slow = int.from_bytes(hashlib.blake2b(f"{seed}/{step}".encode(), digest_size=8).digest(), "little") % ranks
        return base + 100.0 if rank == slow else base
    return base


# -- in every rank of one launch ---------------------------------------------------------------------------------


def _digits(validation: bool) -> Any:
    """The digits (standardized), the first 80 % for training, the rest for validation."""
    from mlp import digits
    from torch.utils.data import TensorDataset

    x, y = digits()
    split = int(0.8 * len(x))
    return TensorDataset(x[split:], y[split:]) if validation else TensorDataset(x[:split], y[:split])


def _model(case: str, seed: int, base: float, ranks: int, lr: float, epochs_steps: int) -> Any:
    import lightning.pytorch as pl
    import torch
    import torchmetrics
    from mlp import build_mlp
    from torch import nn

    class Emulated(pl.LightningModule):
        """The MLP after `compute_ms` of sleep per training step; logs its validation accuracy."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = build_mlp(WIDTHS)
            self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(compute_ms(case, self.global_rank, self.global_step, seed, base, ranks) / 1000)
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.accuracy(self.net(x), y)
            self.log("val_acc", self.accuracy)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs_steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Emulated()


def _launch(job: dict[str, Any], rank: int) -> dict[str, Any]:
    """Every method of the launch on this rank: its step end times and x̄'s accuracy."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_decentral import DecentralizedStrategy

    harness.quiet()
    harness.use_threads(1)
    train, validation = _digits(False), _digits(True)

    class Clock(pl.Callback):
        def __init__(self, ends: list[float]) -> None:
            self.ends = ends

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.monotonic())

    out: dict[str, Any] = {}
    for method in ["ddp", *job["methods"]]:
        strategy: Any = "ddp" if method == "ddp" else DecentralizedStrategy(**METHODS[method])
        ends: list[float] = []
        model = _model(job["case"], job["seed"], job["compute_ms"], job["ranks"], job["lr"], job["steps"])
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=job["ranks"],
            strategy=strategy,
            max_steps=job["steps"],
            callbacks=[Clock(ends)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, DataLoader(train, batch_size=job["batch"], shuffle=True, drop_last=True))
        (metrics,) = trainer.validate(model, DataLoader(validation, batch_size=256), verbose=False)
        out[method] = {"ends": ends, "accuracy": metrics["val_acc"]}
    return out


# -- the launches and their table ---------------------------------------------------------------------------------


def _summary(per_rank: list[list[float]], warmup: int) -> dict[str, Any]:
    """steps/s, the most steps ranks were apart, and each rank's steps when the first rank finished."""
    steps = len(per_rank[0])
    start = max(ends[warmup - 1] for ends in per_rank)
    finish = max(ends[-1] for ends in per_rank)
    first_done = min(ends[-1] for ends in per_rank)
    events = sorted((t, r) for r, ends in enumerate(per_rank) for t in ends)
    done, apart = [0] * len(per_rank), 0
    for _, r in events:
        done[r] += 1
        apart = max(apart, max(done) - min(done))
    return {
        "steps_per_s": (steps - warmup) / (finish - start),
        "apart": apart,
        "when_first_finished": [sum(t <= first_done for t in ends) for ends in per_rank],
    }


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for launch in range(args.repeats):
        for case in args.cases:
            job = {
                "case": case,
                "seed": launch,
                "methods": args.methods,
                "steps": args.steps,
                "ranks": args.ranks,
                "compute_ms": args.compute_ms,
                "batch": args.batch,
                "lr": args.lr,
            }
            started = time.monotonic()
            results = harness.run_ranks(
                functools.partial(_launch, job), args.ranks, timeout=args.timeout, one_node=True
            )
            print(f"launch {launch} {case}: {time.monotonic() - started:.0f} s", flush=True)
            ddp = _summary([r["ddp"]["ends"] for r in results], args.warmup)
            for method in ["ddp", *args.methods]:
                summary = _summary([r[method]["ends"] for r in results], args.warmup)
                row = rows.setdefault(f"{case}/{method}", {"case": case, "method": method, "launches": []})
                row["launches"].append(
                    {
                        **summary,
                        "ratio": summary["steps_per_s"] / ddp["steps_per_s"],
                        "accuracy": results[0][method]["accuracy"],
                    }
                )
    for row in rows.values():
        launches = row["launches"]
        row["steps_per_s"] = statistics.median(x["steps_per_s"] for x in launches)
        row["ratio"] = statistics.median(x["ratio"] for x in launches)
    header = (
        "| case | method | steps/s | × DDP | apart | when the first finished | acc |\n|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['case']} | {r['method']} | {r['steps_per_s']:.2f} | {r['ratio']:.2f} | {r['launches'][0]['apart']} | "
        f"{r['launches'][0]['when_first_finished']} | {r['launches'][0]['accuracy']:.3f} |"
        for r in rows.values()
    ]
    return {"rows": list(rows.values()), "table": "\n".join([header, *lines])}


def _simulated_accuracy(
    combine: str, staleness: int, seed: int, epochs: int, batch: int, lr: float, workers: int
) -> float:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_decentral import RandomDelays, SimulatedDecentralizedStrategy

    pl.seed_everything(seed, verbose=False)
    train, validation = _digits(False), _digits(True)
    steps = epochs * (len(train) // (batch * workers))
    model = _model("none", seed, 0.0, workers, lr, steps)
    strategy = SimulatedDecentralizedStrategy(
        workers=workers,
        combine=combine,
        staleness=staleness,
        delays=RandomDelays(seed) if staleness else None,
        vectorize=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(train, batch_size=batch, shuffle=True, drop_last=True))
    (metrics,) = trainer.validate(model, DataLoader(validation, batch_size=256), verbose=False)
    return float(metrics["val_acc"])


def accuracy(args: argparse.Namespace, rules: tuple[tuple[str, int], ...] = ACCURACY_RULES) -> dict[str, Any]:
    harness.quiet()
    rows = []
    for combine, staleness in rules:
        values = [
            _simulated_accuracy(combine, staleness, seed, args.epochs, args.batch, args.lr, args.ranks)
            for seed in range(args.seeds)
        ]
        rows.append(
            {
                "rule": combine,
                "staleness": staleness,
                "accuracies": values,
                "mean": statistics.mean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            }
        )
        print(f"{combine} s={staleness}: {values}", flush=True)
    header = "| rule | staleness | x̄ accuracy, mean | std over seeds | min | max |\n|---|---|---|---|---|---|"
    lines = [
        f"| {r['rule']} | {r['staleness']} | {r['mean']:.4f} | {r['std']:.4f} | {min(r['accuracies']):.4f} | "
        f"{max(r['accuracies']):.4f} |"
        for r in rows
    ]
    return {"rows": rows, "table": "\n".join([header, *lines])}


def drift(args: argparse.Namespace) -> dict[str, Any]:
    """Stale pure averaging: how far from `x̄(0)` the rows agree (see the module docstring)."""
    import torch

    from lightning_decentral.mixing import DelayedMixing, RandomDelays
    from lightning_decentral.topology import Ring

    rows = []
    for n in sorted({args.ranks, 16}):
        for staleness in (1, 2):
            moved = []
            for seed in range(args.seeds):
                x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
                spread = (x - x.mean(0)).square().sum(1).mean().sqrt()
                mixing, start = DelayedMixing(Ring(world_size=n), staleness, RandomDelays(seed)), x.mean(0)
                for k in range(200):
                    x = mixing.combine("x", x, k)
                moved.append(float(torch.linalg.vector_norm(x.mean(0) - start) / spread))
            rows.append({"workers": n, "staleness": staleness, "mean": statistics.mean(moved), "max": max(moved)})
    header = "| workers | staleness | ‖x̄(200) − x̄(0)‖ / spread, mean | largest |\n|---|---|---|---|"
    lines = [f"| {r['workers']} | {r['staleness']} | {r['mean']:.3f} | {r['max']:.3f} |" for r in rows]
    return {"rows": rows, "table": "\n".join([header, *lines])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES), help=f"of {','.join(CASES)}")
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS), help=f"of {','.join(METHODS)}")
    parser.add_argument("--repeats", type=int, default=3, help="launches per case (seeds 0, 1, ...)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of steps/s")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per step")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank (worker) per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--accuracy", action="store_true", help="the accuracy part (simulation) instead of throughput")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--drift", action="store_true", help="how far stale gossip moves x̄ (no training)")
    parser.add_argument("--smoke", action="store_true", help="a short throughput launch and a short accuracy run")
    parser.add_argument("--out", action="append", default=[], help="a .json (all results) or .md (the table) path")
    args = parser.parse_args(argv)
    harness.exit_on_sigterm()
    meta = {
        "command": harness.command_line(__file__, argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if args.smoke:
        args.cases, args.methods, args.repeats, args.steps, args.warmup = ["random_100"], ["ring_awc_s1"], 1, 6, 2
        args.ranks, args.seeds, args.epochs = 2, 1, 1
        parts = {"throughput": throughput(args), "accuracy": accuracy(args, rules=(("awc", 0), ("awc", 1)))}
    elif args.accuracy:
        parts = {"accuracy": accuracy(args)}
    elif args.drift:
        parts = {"drift": drift(args)}
    else:
        parts = {"throughput": throughput(args)}
    table = "\n\n".join(part["table"] for part in parts.values())
    print(table)
    harness.write_outputs(args.out, {"meta": meta, **{k: v["rows"] for k, v in parts.items()}}, table, indent=1)


if __name__ == "__main__":
    main()
