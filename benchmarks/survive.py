"""`on_peer_failure="continue"`: how fast the survivors train again, what a lost worker costs in accuracy, and what
the option costs when nothing fails. One command per table of ``docs/reliability.md`` ("Surviving a failure") and
``docs/benchmarks.md``::

    python benchmarks/survive.py recovery               # 4 ranks, ring, rank 2 killed at step 20 of 60; 5 runs
    python benchmarks/survive.py accuracy               # digits, 16 simulated workers, 0 / 1 / 4 / 8 lost; 5 seeds
    python benchmarks/survive.py overhead               # failure-free step time: "continue" (and rejoin=True) vs "stop"
    python benchmarks/survive.py rejoin --steps 1500    # 4 ranks, rank 2 killed at step 20, started again, rejoins
    python benchmarks/survive.py recovery --repeats 1 --out table.md --out results.json
    python benchmarks/survive.py accuracy --smoke                 # a couple of steps (tests/test_benchmarks_smoke.py)

* ``recovery``: each run is ``lightning-decentral-launch --nproc-per-node 4`` of this script (``--worker``): a
  ``Trainer`` with ``DecentralizedStrategy(on_peer_failure="continue", timeout=30 s)``, ring, AWC, the MLP of
  ``mlp.py`` (widths ``--widths``), batch 32 of random data per rank; rank ``--victim`` stamps ``time.time()`` and
  kills itself (``SIGKILL``) when step ``--at`` starts. Every survivor records ``time.time()`` at the end of each
  step and the decision. Per survivor: *unblocked*, the end of the first step that ends after the kill (the step it
  was in, or the one after); *mixing*, the end of the first step the survivors mix in again (the agreed step + 1).
  The table gives, per run, the slowest survivor of each (seconds after the kill), and the agreed step.
* ``accuracy``: ``SimulatedDecentralizedStrategy(workers=16, failures={step: lost})`` on the digits of
  ``examples/reproduce/common.py`` (MLP 64-128-128-10, momentum SGD, lr 0.1, global batch 512, 30 epochs, ring,
  AWC), the workers lost at a third of training; the accuracy of the survivors' ``x̄`` on the 359 held-out digits,
  mean ± std over ``--seeds`` seeds (each seed: its own initial model and data order, the same in every row).
* ``rejoin``: as ``recovery``, with ``rejoin=True`` and ``lightning-decentral-launch --max-restarts 1``: the launcher
  starts the killed rank again and it rejoins. Each process records when its imports (torch, Lightning,
  lightning_decentral) are done and when each step starts and ends. Per run: *imports to training*, from the
  restarted process's imports done to the start of its first step; *kill to training*, from the kill to then; *the
  members' pause*, the slowest member's join step (the step it admits the rank in: agreement, group, handover) less
  its median step.
* ``overhead``: ``harness.run_ranks`` of 4 ranks on loopback, the MLP of ``--widths``, ``--steps`` steps (the first
  ``--warmup`` dropped), ``"stop"``, ``"continue"`` and ``"continue"`` with ``rejoin=True`` (one store look per
  step) alternated ``--repeats`` times in one sitting; the median of the slowest rank's step time per mode, and
  their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import harness

SMALL = (64, 256, 256, 10)


# -- recovery: one launch --------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank of a ``recovery`` or ``rejoin`` run, started by lightning-decentral-launch."""
    import lightning.pytorch as pl
    from mlp import MLP, make_loader, quiet_trainer

    from lightning_decentral import DecentralizedStrategy
    from lightning_decentral.membership import Join

    imported = time.time()

    harness.quiet()
    harness.use_threads(1)
    rank, widths = int(os.environ["RANK"]), harness.parse_widths(args.widths, False)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: dict[int, float] = {}
            self.starts: dict[int, float] = {}

        def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
            self.starts[trainer.global_step] = time.time()
            if rank == args.victim and trainer.global_step == args.at:
                Path(args.dir, "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            self.ends[trainer.global_step - 1] = time.time()

    clock = Clock()
    strategy = DecentralizedStrategy(
        topology="ring", on_peer_failure="continue", timeout=timedelta(seconds=30), rejoin=args.rejoin
    )
    trainer = quiet_trainer(
        strategy, args.steps, [clock], devices=int(os.environ["WORLD_SIZE"]), num_sanity_val_steps=0
    )
    trainer.fit(MLP(widths, 0.05, 0.9), train_dataloaders=make_loader(rank, widths, 32, args.steps))
    decisions = [
        {"members": list(d.members), "step": d.step} for d in strategy.failures_survived if not isinstance(d, Join)
    ]
    joins = [{"joined": list(d.joined), "step": d.step} for d in strategy.failures_survived if isinstance(d, Join)]
    record = {"ends": clock.ends, "starts": clock.starts, "decisions": decisions, "joins": joins, "imported": imported}
    Path(args.dir, f"rank-{rank}-{os.getpid()}.json").write_text(json.dumps(record))


def recovery(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:
            killed, ranks = _launch(args, out, repeat)
        (decision,) = {json.dumps(r["decisions"]) for r in ranks}
        step = json.loads(decision)[0]["step"]
        ends = [{int(k): v for k, v in r["ends"].items()} for r in ranks]
        unblocked = max(min(t for t in e.values() if t > killed) for e in ends) - killed
        mixing = max(e[step + 1] for e in ends) - killed
        runs.append({"unblocked_s": unblocked, "mixing_s": mixing, "agreed_step": step, "survivors": len(ranks)})
        print(
            f"run {repeat}: every survivor unblocked {unblocked:.3f} s and mixing {mixing:.3f} s after the kill (step "
            f"{step})"
        )
    rows = [
        f"| {i} | {r['survivors']} | {r['agreed_step']} | {r['unblocked_s']:.2f} | {r['mixing_s']:.2f} |"
        for i, r in enumerate(runs)
    ]
    table = "\n".join(
        [
            "| run | survivors | agreed step | every survivor unblocked (s) | every survivor mixing again (s) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    return {"runs": runs}, table


def _launch(args: argparse.Namespace, out: str, repeat: int) -> tuple[float, list[dict[str, Any]]]:
    """One run of 4 ranks under lightning-decentral-launch (``rejoin``: ``--max-restarts 1``); the kill's time and
    every process's record."""
    restarts = ["--max-restarts", "1"] if args.rejoin else []
    command = [
        sys.executable,
        "-m",
        "lightning_decentral.membership.launch",
        "--nproc-per-node",
        "4",
        *restarts,
        __file__,
    ]
    command += [
        "--worker",
        "--dir",
        out,
        "--victim",
        str(args.victim),
        "--at",
        str(args.at),
        "--steps",
        str(args.steps),
    ]
    command += ["--widths", ",".join(map(str, harness.parse_widths(args.widths, False)))] + (
        ["--rejoin"] if args.rejoin else []
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"run {repeat} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return float(Path(out, "killed").read_text()), [
        json.loads(p.read_text()) for p in sorted(Path(out).glob("rank-*.json"))
    ]


def rejoin(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    args.rejoin = True
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:
            killed, records = _launch(args, out, repeat)
        joiner = next(r for r in records if r["joins"] and not r["decisions"])
        members = [r for r in records if r is not joiner]
        step = joiner["joins"][0]["step"] + 1  # the join step: the first the grown members mix in
        first = min(float(t) for t in joiner["starts"].values())
        pauses = []
        for r in members:
            spans = {int(k): r["ends"][k] - r["starts"][k] for k in r["ends"] if k in r["starts"]}
            pauses.append(spans[step] - statistics.median(spans.values()))
        run = {
            "imports_to_training_s": first - joiner["imported"],
            "kill_to_training_s": first - killed,
            "members_pause_s": max(pauses),
            "join_step": step,
        }
        runs.append(run)
        print(
            f"run {repeat}: "
            + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items())
        )
    rows = [
        f"| {i} | {r['join_step']} | {r['imports_to_training_s']:.2f} | {r['kill_to_training_s']:.2f} | "
        f"{r['members_pause_s']:.3f} |"
        for i, r in enumerate(runs)
    ]
    table = "\n".join(
        [
            "| run | join step | restarted process: imports done to training (s) | kill to training (s) | "
            "slowest member's pause for the join (s) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    return {"runs": runs}, table


# -- accuracy: the simulation ----------------------------------------------------------------------------------


def accuracy(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import lightning.pytorch as pl
    import torch

    from lightning_decentral import SimulatedDecentralizedStrategy

    common = harness.import_example("reproduce/common")
    harness.quiet()
    torch.set_num_threads(1)
    workers, epochs = 16, args.epochs
    per_worker = -(-len(common.digits()[0]) // workers)  # DistributedSampler pads to equal shards
    steps_per_epoch = -(-per_worker // (512 // workers))  # the last batch of an epoch may be short
    at = epochs * steps_per_epoch // 3
    cells = {"none lost": {}, "1 lost": {at: [5]}, "4 lost": {at: [1, 5, 9, 13]}, "8 lost": {at: list(range(0, 16, 2))}}
    results: dict[str, list[float]] = {}
    for label, failures in cells.items():
        for seed in range(args.seeds):
            pl.seed_everything(seed, verbose=False)
            model = common.DigitsMLP(0.1, 0.9, batch=512 // workers, seed=seed)
            strategy = SimulatedDecentralizedStrategy(workers=workers, topology="ring", failures=failures)
            trainer = pl.Trainer(
                strategy=strategy,
                accelerator="cpu",
                devices=1,
                max_epochs=epochs,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                check_val_every_n_epoch=epochs,
            )
            trainer.fit(model)
            results.setdefault(label, []).append(float(trainer.callback_metrics["val_acc"]))
        print(f"{label}: {common.mean_std(results[label])}")
    rows = [
        f"| {label} | {16 - sum(map(len, cells[label].values()))} | {common.mean_std(values)} |"
        for label, values in results.items()
    ]
    table = "\n".join(
        [
            f"| workers lost at step {at} of {epochs * steps_per_epoch} | survivors | accuracy of x̄ ({args.seeds} "
            "seeds) |",
            "|---|---|---|",
            *rows,
        ]
    )
    return {"at_step": at, "accuracy": results}, table


# -- overhead: failure-free steps ------------------------------------------------------------------------------


def _overhead_rank(job: dict[str, Any], rank: int) -> dict[str, Any]:
    from mlp import MLP, StepClock, make_loader, quiet_trainer

    from lightning_decentral import DecentralizedStrategy

    harness.quiet()
    harness.use_threads(1)
    clock = StepClock()
    mode = "continue" if job["mode"] == "rejoin" else job["mode"]
    strategy = DecentralizedStrategy(
        topology="ring", on_peer_failure=mode, timeout=timedelta(seconds=60), rejoin=job["mode"] == "rejoin"
    )
    trainer = quiet_trainer(strategy, job["steps"], [clock], devices=4, num_sanity_val_steps=0)
    widths = tuple(job["widths"])
    trainer.fit(MLP(widths, 0.05, 0.9), train_dataloaders=make_loader(rank, widths, 32, job["steps"]))
    return {"ends": clock.ends}


def overhead(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    widths = harness.parse_widths(args.widths, False)
    times: dict[str, list[float]] = {"stop": [], "continue": [], "rejoin": []}
    for repeat in range(args.repeats):
        for mode in ("stop", "continue", "rejoin") if repeat % 2 == 0 else ("rejoin", "continue", "stop"):
            job = {"mode": mode, "steps": args.steps, "widths": list(widths)}
            records = harness.run_ranks(lambda rank, job=job: _overhead_rank(job, rank), 4, timeout=600, one_node=True)
            times[mode] += harness.step_times(records, args.warmup)
    median = {mode: statistics.median(values) for mode, values in times.items()}
    ratio = median["continue"] / median["stop"]
    print(
        f"median step: stop {1e3 * median['stop']:.2f} ms, continue {1e3 * median['continue']:.2f} ms, ratio "
        f"{ratio:.3f}"
    )
    table = "\n".join(
        [
            '| on_peer_failure | median step (ms) | ratio to "stop" |',
            "|---|---|---|",
            f'| "stop" | {1e3 * median["stop"]:.2f} | 1.000 |',
            f'| "continue" | {1e3 * median["continue"]:.2f} | {ratio:.3f} |',
            f'| "continue", rejoin=True | {1e3 * median["rejoin"]:.2f} | {median["rejoin"] / median["stop"]:.3f} |',
        ]
    )
    return {"median_s": median, "ratio": ratio, "parameters": harness.count_parameters(widths)}, table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="?", choices=["recovery", "accuracy", "overhead", "rejoin"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--widths", default=",".join(map(str, SMALL)))
    parser.add_argument("--out", action="append", default=[])
    parser.add_argument(
        "--smoke", action="store_true", help="a couple of steps: 1 seed of 1 epoch, 1 repeat of 8 steps"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)  # a worker's output directory
    parser.add_argument("--rejoin", action="store_true", help=argparse.SUPPRESS)  # a worker of ``rejoin``
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.smoke:
        args.seeds, args.epochs, args.repeats, args.steps, args.at, args.warmup = 1, 1, 1, 8, 3, 2
    body, table = {"recovery": recovery, "accuracy": accuracy, "overhead": overhead, "rejoin": rejoin}[args.part](args)
    body["command"] = harness.command_line(__file__, argv)
    print(table)
    harness.write_outputs(args.out, body, table)


if __name__ == "__main__":
    main()
