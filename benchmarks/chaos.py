"""Chaos soak: a random worker ``SIGKILL``ed every ``--kill-every`` steps and started again, against the same run
without failures and against the restart path (torchrun ``--max-restarts`` from the last checkpoint)::

    python benchmarks/chaos.py                                    # 4 workers, 300 steps, a kill every 30 steps
    python benchmarks/chaos.py --workers 6 --steps 600 --seeds 3 --out chaos.md --out chaos.json
    python benchmarks/chaos.py --smoke                            # 3 workers, 90 steps, one kill (the tests)

Every run trains the digits MLP of ``examples/reproduce/common.py`` (momentum SGD, lr 0.1, batch 32 per worker,
each worker its shard) with ``DecentralizedStrategy`` on a ring, on ``--workers`` processes over gloo, and
validates ``x̄`` on the 359 held-out digits at the last step. Three modes, each for every seed:

* ``free``: ``lightning-decentral-launch``, ``on_peer_failure="continue", rejoin=True``, nothing killed;
* ``rejoin``: ``lightning-decentral-launch --max-restarts K``, the same strategy; each time the run's
  furthest step passes a multiple of ``--kill-every``, this script kills a random worker that is training
  (``SIGKILL`` by the PID it wrote), the launcher starts it again and it rejoins the others;
* ``torchrun``: ``torchrun --max-restarts K``, ``on_peer_failure="stop"``, ``ModelCheckpoint`` every
  ``--save-every`` steps with ``last.ckpt``, every start resuming from ``last.ckpt``: the same kills make torchrun
  stop every worker and start them all again from the last save.

Each worker appends the end of every step (its number and ``time.time()``), and its process's start, to a file of
its own; a start no kill explains (a worker that failed and was started again) is counted and reported. Goodput is the
worker-steps of the final trajectory per second of wall time, from the launch until the launcher exits: for each
worker the distinct steps it completed (a step done again after a rollback counts once, a step missed while dead
not at all), summed over the workers, over the wall time. The report gives it per mode and its ratio to ``free``;
whether every worker still running at the end ended at the last step; and the accuracy on the 359 held-out digits of
``x̄``, the mean of the replicas of the workers that ended the run (Lightning's own validation, also recorded as
``val_acc``, sees only the ranks' shares of those digits). Every step sleeps ``--step-sleep`` seconds first (emulated
compute: on 2 cores the MLP's own steps are shorter than a restart by far). ``free`` and ``rejoin`` save a checkpoint at
the last step; a further launch on as many processes resumes it, and ``resumes_exactly`` says whether every rank's
replica at the start of that fit equals the one it ended with, bit for bit. The JSON also keeps each worker's end
(``results``: its step, world size, whether its replica is finite, the survivors' decisions it adopted) and the
launcher's own lines (``launcher``: each worker's exit and each start again).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import harness

MODES = ("free", "rejoin", "torchrun")


# -- one worker ------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank of a run (started by the launcher or by torchrun): trains, records every step, validates at the end."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_decentral import DecentralizedStrategy

    common = harness.import_example("reproduce/common")
    harness.quiet()
    harness.use_threads(1)
    rank, out = int(os.environ["RANK"]), Path(args.dir)
    Path(out, f"pid-{rank}").write_text(str(os.getpid()))
    progress = open(Path(out, f"progress-{rank}"), "a", buffering=1)
    progress.write(f"start {time.time()}\n")  # this process began (a start, or a start again)

    def replica(module: pl.LightningModule) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()

    class Progress(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if args.mode == "check":  # the replica as the end checkpoint restored it
                torch.save(replica(module), out / f"resumed-{rank}.pt")

        def on_train_batch_start(self, *rest: Any) -> None:
            time.sleep(args.step_sleep)  # emulated compute

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            progress.write(f"{trainer.global_step} {time.time()}\n")

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if args.mode != "check":
                torch.save(replica(module), out / f"replica-{rank}.pt")

    callbacks: list[pl.Callback] = [Progress()]
    resume, steps, end = None, args.steps, out / "end" / "end.ckpt"
    if args.mode == "torchrun":
        callbacks.append(
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=args.save_every, save_last=True)
        )
        resume = "last" if Path(out, "checkpoints", "last.ckpt").exists() else None
    elif args.mode == "check":
        resume, steps = end, args.steps + 1  # resume the end checkpoint on as many processes, one step more
    else:  # the checkpoint at the end, which the check mode resumes
        callbacks.append(ModelCheckpoint(dirpath=end.parent, filename=end.stem, every_n_train_steps=args.steps))
    survive = {"on_peer_failure": "continue", "rejoin": True}  # free: the same strategy as rejoin, nothing killed
    options = {"on_peer_failure": "stop"} if args.mode == "torchrun" else survive
    strategy = DecentralizedStrategy(topology="ring", timeout=timedelta(seconds=30), **options)
    pl.seed_everything(args.seed, verbose=False)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        check_val_every_n_epoch=None,
        val_check_interval=args.steps,
    )
    trainer.fit(common.DigitsMLP(0.1, 0.9, batch=32, seed=args.seed), ckpt_path=resume)
    if args.mode == "check":
        return
    accuracy = trainer.callback_metrics.get("val_acc")
    result = {
        "step": trainer.global_step,
        "val_acc": None if accuracy is None else float(accuracy),
        "world_size": trainer.world_size,
        "finite": bool(torch.isfinite(replica(trainer.lightning_module)).all()),
        "decisions": [dataclasses.asdict(decision) for decision in strategy.failures_survived],
    }
    Path(out, f"result-{rank}.json").write_text(json.dumps(result))


# -- one run ---------------------------------------------------------------------------------------------------


def _command(mode: str, args: argparse.Namespace, out: str, seed: int) -> list[str]:
    restarts = str(args.max_restarts)
    if mode == "torchrun":
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.workers),
            "--max-restarts",
            restarts,
        ]
    else:
        launch = [sys.executable, "-m", "lightning_decentral.membership.launch", "--nproc-per-node", str(args.workers)]
        launch += ["--max-restarts", restarts] if mode == "rejoin" else []
    work = [
        "--worker",
        "--mode",
        mode,
        "--dir",
        out,
        "--steps",
        str(args.steps),
        "--seed",
        str(seed),
        "--save-every",
        str(args.save_every),
        "--step-sleep",
        str(args.step_sleep),
    ]
    return [*launch, __file__, *work]


def _progress(out: str, rank: int) -> list[tuple[str, float]]:
    """Worker `rank`'s lines so far: `(step, time)` at the end of each step, `("start", time)` when a process began."""
    path = Path(out, f"progress-{rank}")
    lines = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(what, float(at)) for what, at in (line for line in lines if len(line) == 2)]


def _steps(out: str, rank: int) -> list[tuple[int, float]]:
    return [(int(what), at) for what, at in _progress(out, rank) if what != "start"]


def _back(progress: list[tuple[str, float]], killed: float) -> dict[str, float | None]:
    """Seconds from a kill at `killed` to the worker's next process start (`started_s`) and its next step's end
    (`training_s`); `None` if there was none."""
    later = [(what, at) for what, at in progress if at > killed]
    started = next((at for what, at in later if what == "start"), None)
    stepped = next((at for what, at in later if what != "start" and started is not None and at > started), None)
    return {
        "started_s": None if started is None else started - killed,
        "training_s": None if stepped is None else stepped - killed,
    }


def _training(out: str, rank: int, since: float) -> bool:
    """Whether worker `rank` completed a step since `since` (it is training, not starting or rejoining)."""
    steps = _steps(out, rank)
    return bool(steps) and steps[-1][1] > since


@contextlib.contextmanager
def _run_directory(args: argparse.Namespace, prefix: str) -> Iterator[str]:
    """Where a run writes: removed after it unless `--keep` (then its path is printed, to read the progress files
    and the launcher's log)."""
    if not args.keep:
        with tempfile.TemporaryDirectory(dir=args.directory, prefix=prefix) as out:
            yield out
        return
    out = tempfile.mkdtemp(dir=args.directory, prefix=prefix)
    print(f"kept: {out}")
    yield out


def run(mode: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One run of `mode`: the launcher's process, the kills, and what the workers recorded."""
    chooser = random.Random(seed)
    with _run_directory(args, f"{mode}-{seed}-") as out:
        start = time.time()
        output = open(Path(out, "launcher.log"), "w+")  # a file, not a pipe: nobody blocks on a full pipe meanwhile
        launcher = subprocess.Popen(
            _command(mode, args, out, seed), stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        kills: list[dict[str, Any]] = []
        next_kill, restarted_at, timed_out = args.kill_every, {r: start for r in range(args.workers)}, False
        try:
            while launcher.poll() is None:
                if time.time() - start > args.timeout:
                    timed_out = True
                    break
                furthest = max((s[-1][0] for s in (_steps(out, r) for r in range(args.workers)) if s), default=0)
                if mode != "free" and furthest >= next_kill and next_kill < args.steps:
                    live = [r for r in range(args.workers) if _training(out, r, restarted_at[r])]
                    if live:
                        victim = chooser.choice(live)
                        pid = int(Path(out, f"pid-{victim}").read_text())
                        os.kill(pid, signal.SIGKILL)
                        now = time.time()
                        for rank in range(args.workers) if mode == "torchrun" else [victim]:  # torchrun restarts all
                            restarted_at[rank] = now
                        kills.append({"step": furthest, "rank": victim, "pid": pid, "at": now - start})
                        next_kill += args.kill_every
                time.sleep(0.05)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            output.seek(0)
            log = output.read()
            output.close()
        wall = time.time() - start
        steps = {r: _steps(out, r) for r in range(args.workers)}
        starts = sum(what == "start" for r in range(args.workers) for what, _ in _progress(out, r))
        for kill in kills:  # how long the worker it killed took to start again and to end a step again
            kill.update(_back(_progress(out, kill["rank"]), start + kill["at"]))
        ended = sorted(r for r in range(args.workers) if Path(out, f"replica-{r}.pt").exists())
        accuracy = _accuracy_of_mean([Path(out, f"replica-{r}.pt") for r in ended]) if ended else None
        resumes = _resumes_exactly(args, out, seed, ended) if mode != "torchrun" and launcher.returncode == 0 else None
        if timed_out:
            reached = {r: s[-1][0] if s else None for r, s in steps.items()}
            raise TimeoutError(
                f"{mode} run (seed {seed}) still running after {args.timeout} s; the last step of each "
                f"worker: {reached}; kills: {kills}; the launcher's output:\n{log[-6000:]}"
            )
        results = {
            r: json.loads(p.read_text()) for r in range(args.workers) if (p := Path(out, f"result-{r}.json")).exists()
        }
    distinct = sum(len({step for step, _ in s}) for s in steps.values())
    planned = args.workers + len(kills) * (args.workers if mode == "torchrun" else 1)  # torchrun starts all again
    return {
        "mode": mode,
        "seed": seed,
        "exit": launcher.returncode,
        "wall_s": wall,
        "worker_steps": distinct,
        "goodput": distinct / wall,
        "kills": kills,
        "unplanned_starts": starts - planned,
        "ended_at": {r: res["step"] for r, res in results.items()},
        "results": results,  # each worker's at the end: step, val_acc, world_size, finite, decisions
        "accuracy": accuracy,
        "val_acc": results.get(0, {}).get("val_acc"),
        "resumes_exactly": resumes,
        "log": log[-3000:],
        "launcher": [line for line in log.splitlines() if line.startswith("lightning-decentral-launch:")],
    }


def _accuracy_of_mean(replicas: list[Path]) -> float:
    """The accuracy on the 359 held-out digits of the mean of the replicas saved at `replicas`."""
    import torch

    common = harness.import_example("reproduce/common")
    module = common.DigitsMLP(0.1, 0.9)
    torch.nn.utils.vector_to_parameters(torch.stack([torch.load(p) for p in replicas]).mean(0), module.parameters())
    images, labels = common.digits()[1].tensors
    with torch.no_grad():
        return float((module.net(images).argmax(1) == labels).float().mean())


def _resumes_exactly(args: argparse.Namespace, out: str, seed: int, ended: list[int]) -> bool:
    """Whether the checkpoint a run saved at its last step, resumed by a new launch on as many processes as ranks
    ended the run (`ended`, by their first ranks, renumbered in that order as the survivors are), gives every rank
    the replica it ended with, bit for bit."""
    check = argparse.Namespace(**{**vars(args), "workers": len(ended)})
    done = subprocess.run(_command("check", check, out, seed), capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"resuming the end checkpoint failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    import torch

    pairs = [(Path(out, f"replica-{first}.pt"), Path(out, f"resumed-{now}.pt")) for now, first in enumerate(ended)]
    return all(torch.equal(torch.load(a), torch.load(b)) for a, b in pairs)


# -- the report ------------------------------------------------------------------------------------------------


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    free = (
        statistics.mean(r["goodput"] for r in runs if r["mode"] == "free")
        if any(r["mode"] == "free" for r in runs)
        else None
    )
    rows = []
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        goodput = statistics.mean(r["goodput"] for r in mine)
        ratio = f"{goodput / free:.2f}" if free else "–"
        ended = all(all(step == args.steps for step in r["ended_at"].values()) and r["ended_at"] for r in mine)
        at_end = statistics.mean(len(r["ended_at"]) for r in mine)
        accuracies = [r["accuracy"] for r in mine if r["accuracy"] is not None]
        accuracy = f"{statistics.mean(accuracies):.4f} ± {statistics.pstdev(accuracies):.4f}" if accuracies else "–"
        kills = statistics.mean(len(r["kills"]) for r in mine)
        unplanned = sum(r["unplanned_starts"] for r in mine)
        rows.append(
            f"| {mode} | {len(mine)} | {kills:.1f} | {unplanned} | {goodput:.1f} | {ratio} | {at_end:.1f} of "
            f"{args.workers} | {'yes' if ended else 'no'} | {accuracy} |"
        )
    return "\n".join(
        [
            "| mode | runs | kills per run | starts not caused by a kill | goodput (worker-steps/s) | ratio to free "
            f"| workers that ended the run (mean) | each of them at step {args.steps} | accuracy of x̄ |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-every", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10, help="torchrun mode: the checkpoint interval")
    parser.add_argument("--max-restarts", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take before it is killed")
    parser.add_argument("--directory", default=None, help="where the runs write (default: the system's temporary)")
    parser.add_argument("--out", action="append", default=[])
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (progress files, logs)")
    parser.add_argument("--smoke", action="store_true", help="3 workers, 90 steps, a kill at step 45")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--step-sleep", type=float, default=0.2, help="seconds of emulated compute per step")
    parser.add_argument("--mode", choices=[*MODES, "check"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.smoke:
        args.workers, args.steps, args.kill_every, args.timeout = 3, 90, 45, 240.0
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}: choose among {', '.join(MODES)}")
    runs = []
    for seed in range(args.seeds):
        for mode in args.modes:
            result = run(mode, args, seed)
            runs.append(result)
            print(
                f"{mode} seed {seed}: exit {result['exit']}, {result['wall_s']:.1f} s, goodput {result['goodput']:.1f} "
                f"worker-steps/s, {len(result['kills'])} kills, {result['unplanned_starts']} starts not caused by a "
                f"kill, ended at {result['ended_at']}, accuracy of x̄ {result['accuracy']}, resumes exactly "
                f"{result['resumes_exactly']}"
            )
            if result["exit"] or result["unplanned_starts"]:
                print(result["log"])
    table = report(runs, args)
    print(table)
    harness.write_outputs(
        args.out, {"command": harness.command_line(__file__, argv), "runs": runs, "load": os.getloadavg()}, table
    )


if __name__ == "__main__":
    main()
