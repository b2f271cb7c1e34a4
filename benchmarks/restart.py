"""What a job that can restart pays and loses: the step-time cost of checkpointing every N steps, and the time from
a killed rank to the first step after torchrun restarted the job.

::

    python benchmarks/restart.py                    # both parts, ~12 minutes on 2 cores
    python benchmarks/restart.py --kills 0          # the step-time cost only
    python benchmarks/restart.py --methods "" --kills 20 --job-steps 800   # a soak: 20 restarts under torchrun
    python benchmarks/restart.py --smoke            # tiny model, a few steps, no torchrun

**Cost per step.** Every method trains ``benchmarks/step_time.py``'s MLP (5,257,226 parameters, SGD with momentum,
batch 32 per process) with ``DecentralizedStrategy()`` (ring, AWC; ``dpsgd`` below) or, for the methods prefixed
``ddp_``, Lightning's ``strategy="ddp"`` (the anchor: one file, written by rank 0), on ``--workers`` CPU processes over
gloo, one method after another in the same run, ``--repeats`` times in rotated order (as ``step_time.py`` does):
``none`` saves nothing; ``every N`` has ``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` (a checkpoint and
``last.ckpt`` every N steps, the previous ones removed; under ``dpsgd`` each with its 4 shards) saving synchronously,
``every N background`` the same under Lightning's ``AsyncCheckpointIO`` (under ``dpsgd``, the strategy's background
saves), and ``every N link`` saves synchronously with ``last.ckpt`` a link to the step's checkpoint
(``save_last="link"``) instead of a second save. The cost of a method is its mean step over the ``--steps`` measured
steps (the slowest rank's wall time from the end of the last warm-up step to the end of the last step, divided by the
steps: saves included), against ``none``'s of the same strategy (``ddp_none`` for a ``ddp_`` method); the training
time a save step costs is that difference times the measured steps, over the save steps among them. The same for
the CPU time of every rank together over those steps (each process's, all its threads: training, gloo's, the
background writer's), which other jobs on the machine disturb much less than the wall time; also the time ``fit``
took after the last step (waiting for the saves still in flight, and the teardown).

**Kill to first step.** ``--kills K`` then runs one job under ``torchrun --nproc-per-node=W --max-restarts=K`` with
background saves every ``--every`` steps and ``fit(ckpt_path="last")`` with ``resume="newest_complete"``; at attempt
``a < K``, rank ``a % W`` stops at a step ``--kill-after`` steps past the one it resumed from, and this script kills it
with SIGKILL. For each restart it reports the seconds from the kill to the end of the first step of the restarted
job (the slowest rank), and to the moment every new worker had started Python and imported torch and Lightning
(the top of this script), the step it resumed from and the steps lost (the kill's step minus the resumed one), and
at the end whether the job exited 0 and every rank reached ``--job-steps``.
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.time()  # before the imports: a restarted worker's interpreter is up

import argparse
import cProfile
import functools
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from mlp import MLP, StepClock, make_loader, quiet_trainer

from lightning_decentral import DecentralizedStrategy

DEFAULT_METHODS = (
    "none,every10,every10_background,every10_link,every50,every50_background,every50_link,"
    "ddp_none,ddp_every10,ddp_every10_background,ddp_every50,ddp_every50_background"
)
SMOKE_METHODS = "none,every2_background,ddp_none,ddp_every2_background"


def _method(name: str) -> tuple[str, int | None, bool, bool | str]:
    """``[ddp_]none``, ``[ddp_]every<N>``, ``[ddp_]every<N>_background`` or ``[ddp_]every<N>_link`` -> (the strategy,
    ``"dpsgd"`` or ``"ddp"``; N or None; background; save_last)."""
    strategy, rest = ("ddp", name.removeprefix("ddp_")) if name.startswith("ddp_") else ("dpsgd", name)
    if rest == "none":
        return strategy, None, False, True
    every, _, mode = rest.removeprefix("every").partition("_")
    if not rest.startswith("every") or not every.isdigit() or mode not in ("", "background", "link"):
        raise ValueError(
            f"unknown method {name!r}: none, every<N>, every<N>_background or every<N>_link, each with a prefix ddp_ "
            "for Lightning's DDP (a link to a checkpoint saved in the background is refused: it may name a file not "
            "yet written)"
        )
    return strategy, int(every), mode == "background", "link" if mode == "link" else True


def _baseline(name: str) -> str:
    """The method a method's ratio is taken against: ``none`` of the same strategy."""
    return "ddp_none" if _method(name)[0] == "ddp" else "none"


def _saves(every: int | None, warmup: int, steps: int) -> int:
    """The save steps inside the measured window: ``ModelCheckpoint`` saves at the end of the batch that makes
    ``global_step`` a multiple of ``every``, after ``StepClock`` noted the batch's end, so the save of step ``g``
    falls in batch ``g``'s (0-based) interval, and the window holds batches ``warmup .. warmup + steps - 1``.

    >>> _saves(10, 5, 100), _saves(10, 2, 50), _saves(None, 5, 100)
    (10, 5, 0)
    """
    return 0 if every is None else sum(1 for g in range(max(warmup, 1), warmup + steps) if g % every == 0)


class ProfiledCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose hook at the end of a training batch (where it saves) runs under ``cProfile``, clocked
    by this process's CPU time (all its threads', gloo's included; a background writer's work after the hook returned
    is not in it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.profile = cProfile.Profile(time.process_time)

    def on_train_batch_end(self, *args: Any) -> None:
        self.profile.enable()
        try:
            super().on_train_batch_end(*args)
        finally:
            self.profile.disable()

    def top(self, save_steps: int, count: int = 14) -> list[tuple[str, int, float]]:
        """The library's functions, ``torch.save`` and the collectives that took the most CPU time inside the hook:
        ``(name, calls, CPU s per save step)``."""
        rows = []
        for (path, _, function), (_, calls, _, cumulative, _) in pstats.Stats(self.profile).stats.items():
            collective = "distributed_c10d" in path and function in ("all_reduce", "all_gather", "barrier", "broadcast")
            if "lightning_decentral" in path or collective or ("torch/serialization" in path and function == "save"):
                where = path.rpartition("lightning_decentral/")[2] if "lightning_decentral" in path else Path(path).name
                name = f"{where}:{function}"
                rows.append((name, calls, cumulative / save_steps))
        return sorted(rows, key=lambda row: -row[2])[:count]


def _trainer(
    config: dict[str, Any],
    every: int | None,
    background: bool,
    directory: str,
    callbacks: list,
    save_last: bool | str = True,
    strategy: str = "dpsgd",
    **kwargs: Any,
) -> Any:
    saving = ProfiledCheckpoint if config.get("profile") else ModelCheckpoint
    saves = [saving(directory, every_n_train_steps=every, save_last=save_last)] if every else []
    return quiet_trainer(
        "ddp" if strategy == "ddp" else DecentralizedStrategy(**kwargs),
        config["warmup"] + config["steps"],
        [*callbacks, *saves],
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        use_distributed_sampler=False,
        enable_checkpointing=bool(every),
        plugins=[AsyncCheckpointIO()] if background else None,
    )


class CpuClock(StepClock):
    """``StepClock``, and this process's CPU time (all its threads': gloo's, the background writer's) at every batch
    end."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        self.cpu.append(time.process_time())


def _train(config: dict[str, Any], name: str, directory: str, rank: int) -> dict[str, Any]:
    """One rank of one method: its step ends (wall and CPU time), and when `fit` returned."""
    harness.use_threads(1)
    harness.quiet()
    strategy, every, background, save_last = _method(name)
    clock = CpuClock()
    trainer = _trainer(config, every, background, directory, [clock], save_last, strategy)
    widths = tuple(config["widths"])
    total = config["warmup"] + config["steps"]
    trainer.fit(MLP(widths, 0.01, 0.9), make_loader(rank, widths, config["batch_size"], total))
    record = {"ends": clock.ends, "cpu": clock.cpu, "returned": time.perf_counter()}
    for callback in trainer.callbacks:
        if isinstance(callback, ProfiledCheckpoint):
            record["profile"] = callback.top(total // every)
    return record


def cost_per_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = {"warmup": args.warmup, "steps": args.steps, "widths": list(args.widths), "batch_size": args.batch_size}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.methods}
    profiles: dict[str, list[Any]] = {}
    for repeat in range(args.repeats):
        for name in args.methods[repeat % len(args.methods) :] + args.methods[: repeat % len(args.methods)]:
            with tempfile.TemporaryDirectory(dir=args.directory) as directory:  # the parent's: outlives every rank
                profiled = {**config, "profile": args.profile and repeat == 0}
                records = harness.run_ranks(
                    functools.partial(_train, profiled, name, directory),
                    args.workers,
                    timeout=args.timeout,
                    one_node=True,
                )
            if "profile" in records[0]:
                profiles[name] = [records[0]["profile"], records[-1]["profile"]]
            w, s = args.warmup, args.steps
            run = {
                "mean_step_s": max((r["ends"][w + s - 1] - r["ends"][w - 1]) / s for r in records),
                "cpu_per_step_s": sum((r["cpu"][w + s - 1] - r["cpu"][w - 1]) / s for r in records),
                "after_last_step_s": max(r["returned"] - r["ends"][-1] for r in records),
            }
            runs[name].append(run)
            print(
                f"  repeat {repeat + 1}/{args.repeats}  {name:<22} mean step {run['mean_step_s']:.4f} s, CPU per step "
                f"{run['cpu_per_step_s']:.4f} s, after the last step {run['after_last_step_s']:.2f} s",
                flush=True,
            )
    rows = []
    for name in args.methods:
        rows.append(
            {
                "method": name,
                "mean_step_s": statistics.mean(run["mean_step_s"] for run in runs[name]),
                "repeats_s": [run["mean_step_s"] for run in runs[name]],
                "cpu_per_step_s": statistics.mean(run["cpu_per_step_s"] for run in runs[name]),
                "after_last_step_s": statistics.mean(run["after_last_step_s"] for run in runs[name]),
                **({"profile": profiles[name]} if name in profiles else {}),
            }
        )
    by_name = {row["method"]: row for row in rows}
    for row in rows:
        base = by_name.get(_baseline(row["method"]))
        saves = _saves(_method(row["method"])[1], args.warmup, args.steps)
        for key, ratio, per_save in (
            ("mean_step_s", "ratio_to_none", "per_save_step_s"),
            ("cpu_per_step_s", "cpu_ratio_to_none", "cpu_per_save_step_s"),
        ):
            row[ratio] = row[key] / base[key] if base else None
            row[per_save] = (row[key] - base[key]) * args.steps / saves if base and saves else None
    return rows


def render_cost(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | mean step (s) | each repeat (s) | ratio to its strategy's none | training time per save step (s) "
        "| CPU per step, all ranks (s) | CPU ratio to its none | CPU per save step (s) | fit after the last step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def shown(value: float | None, digits: int) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    for r in rows:
        repeats = ", ".join(f"{t:.4f}" for t in r["repeats_s"])
        lines.append(
            f"| {r['method']} | {r['mean_step_s']:.4f} | {repeats} | {shown(r['ratio_to_none'], 3)} | "
            f"{shown(r['per_save_step_s'], 3)} | {r['cpu_per_step_s']:.4f} | {shown(r['cpu_ratio_to_none'], 3)} | "
            f"{shown(r['cpu_per_save_step_s'], 3)} | {r['after_last_step_s']:.2f} |"
        )
    return "\n".join(lines)


def render_profiles(rows: list[dict[str, Any]]) -> str:
    """``--profile``: per method, the functions that took the most CPU time per save step, on rank 0 and the last
    rank."""
    parts = []
    for r in rows:
        if "profile" in r:
            first, last = ({name: (calls, cpu) for name, calls, cpu in ranks} for ranks in r["profile"])
            lines = [
                f"{r['method']}: CPU s per save step inside the save hook",
                "",
                "| function | calls, rank 0 | rank 0 | last rank |",
                "|---|---|---|---|",
            ]
            for name, (calls, cpu) in first.items():
                lines.append(f"| {name} | {calls} | {cpu:.4f} | {last.get(name, (0, 0.0))[1]:.4f} |")
            parts.append("\n".join(lines))
    return "\n\n".join(parts)


# -- kill to first step, under torchrun ---------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: `fit(ckpt_path="last")`, background saves; at attempt `a < kills`, rank `a % W`
    writes its pid to `<root>/paused-<a>` at step `resumed + kill_after` and waits to be killed."""
    harness.use_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    root = Path(args.root)
    (root / "pids").mkdir(exist_ok=True)
    (root / "pids" / f"{attempt}-{rank}").write_text(str(os.getpid()))
    record: dict[str, Any] = {"python_started": SCRIPT_STARTED, "worker_started": time.time()}  # after the imports

    class Timeline(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            record["resumed"] = trainer.global_step

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            victim = attempt < args.kills and rank == attempt % world_size
            if victim and trainer.global_step == record["resumed"] + args.kill_after:
                (root / f"paused-{attempt}").write_text(f"{os.getpid()} {trainer.global_step}")
                time.sleep(600)

        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            if "first_step_end" not in record:
                record["first_step_end"] = time.time()
                torch.save(record, root / f"first-{attempt}-{rank}.pt")  # before a kill can take it

    config = {"warmup": 0, "steps": args.job_steps}
    trainer = _trainer(config, args.every, True, str(root / "checkpoints"), [Timeline()], resume="newest_complete")
    widths = tuple(args.widths)
    trainer.fit(MLP(widths, 0.01, 0.9), make_loader(rank, widths, args.batch_size, args.job_steps), ckpt_path="last")
    torch.save({**record, "end_step": trainer.global_step}, root / f"record-{attempt}-{rank}.pt")


def kill_to_first_step(args: argparse.Namespace) -> dict[str, Any]:
    """Run the job under torchrun, kill a rank at each attempt but the last; the timeline of every restart."""
    root = Path(tempfile.mkdtemp(dir=args.directory, prefix="restart_"))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.workers}",
        f"--max-restarts={args.kills}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{harness.free_port()}",
        "--monitor-interval=0.1",
        __file__,
        "--worker",
        "--root",
        str(root),
        "--job-steps",
        str(args.job_steps),
        "--every",
        str(args.every),
        "--kill-after",
        str(args.kill_after),
        "--kills",
        str(args.kills),
        "--widths",
        ",".join(map(str, args.widths)),
        "--batch-size",
        str(args.batch_size),
    ]
    kills: list[dict[str, Any]] = []
    started = time.monotonic()
    with open(root / "torchrun.log", "w") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        while agent.poll() is None and time.monotonic() - started < args.timeout:
            paused = root / f"paused-{len(kills)}"
            if len(kills) < args.kills and paused.exists() and len(paused.read_text().split()) == 2:
                pid, step = map(int, paused.read_text().split())
                os.kill(pid, signal.SIGKILL)
                kills.append({"attempt": len(kills), "killed_at": time.time(), "step": step})
                print(
                    f"  attempt {len(kills) - 1}: killed rank {(len(kills) - 1) % args.workers} at step {step}",
                    flush=True,
                )
            time.sleep(0.05)
        code = agent.poll()
    finally:
        for pid in [agent.pid, *(int(p.read_text()) for p in (root / "pids").glob("*"))]:
            try:
                os.kill(pid, signal.SIGKILL)  # torchrun, and the workers it started (each in its own session)
            except ProcessLookupError:
                pass
    restarts = []
    for kill in kills:
        paths = [root / f"first-{kill['attempt'] + 1}-{r}.pt" for r in range(args.workers)]
        after = [torch.load(path) for path in paths if path.exists()]
        if len(after) < args.workers:
            nan = float("nan")
            restarts.append(
                {
                    **kill,
                    "resumed": None,
                    "steps_lost": None,
                    "kill_to_python_s": nan,
                    "kill_to_workers_started_s": nan,
                    "kill_to_first_step_s": nan,
                }
            )
            continue
        restarts.append(
            {
                **kill,
                "resumed": after[0]["resumed"],
                "steps_lost": kill["step"] - after[0]["resumed"],
                "kill_to_python_s": max(r["python_started"] for r in after)
                - kill["killed_at"],  # the last rank's interpreter up
                "kill_to_workers_started_s": max(r["worker_started"] for r in after)
                - kill["killed_at"],  # its imports done
                "kill_to_first_step_s": max(r["first_step_end"] for r in after) - kill["killed_at"],
            }
        )
    final = [root / f"record-{args.kills}-{r}.pt" for r in range(args.workers)]
    return {
        "exit_code": code,
        "restarts": restarts,
        "finished": all(p.exists() and torch.load(p)["end_step"] == args.job_steps for p in final),
        "log": str(root / "torchrun.log"),
    }


def render_kills(result: dict[str, Any]) -> str:
    lines = [
        "| restart | killed at step | resumed from step | steps lost | kill to every new interpreter up (s) "
        "| kill to every new worker's imports done (s) | kill to first step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["restarts"]:
        lines.append(
            f"| {r['attempt'] + 1} | {r['step']} | {r['resumed']} | {r['steps_lost']} | {r['kill_to_python_s']:.1f} "
            f"| {r['kill_to_workers_started_s']:.1f} "
            f"| {r['kill_to_first_step_s']:.1f} |"
        )
    return (
        "\n".join(lines)
        + f"\n\ntorchrun exit code {result['exit_code']}; every rank reached the last step: {result['finished']}"
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods",
        default=None,
        help=(
            "comma-separated: none, every<N>, every<N>_background or every<N>_link, each with a prefix ddp_ for "
            f"Lightning's DDP (default {DEFAULT_METHODS})"
        ),
    )
    parser.add_argument("--steps", type=int, default=None, help="measured steps per method (default 100; --smoke: 4)")
    parser.add_argument("--job-steps", type=int, default=300, help="the torchrun job's steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--widths", default=None, help="MLP widths (default step_time.py's: 1024,2048,1024,1024,10)")
    parser.add_argument(
        "--kills", type=int, default=None, help="restarts under torchrun after the cost table (default 3; --smoke: 0)"
    )
    parser.add_argument("--every", type=int, default=10, help="the torchrun job's checkpoint interval")
    parser.add_argument(
        "--kill-after", type=int, default=25, help="steps past the resumed one at which a rank is killed"
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--directory", default=None, help="where checkpoints are written (default: the system's temporary directory)"
    )
    parser.add_argument("--out", action="append", default=[], help="write results: .md (tables) or .json; repeatable")
    parser.add_argument(
        "--profile",
        action="store_true",
        help=(
            "profile the saves of the first repeat: CPU time per function, rank 0 and the last rank (the process's: in "
            "the background, the writer thread's counts for what the hook runs meanwhile)"
        ),
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.widths = harness.parse_widths(args.widths, args.smoke)
    if args.worker:
        return args
    if args.smoke:
        args.methods = args.methods or SMOKE_METHODS
        args.steps, args.warmup, args.repeats, args.workers = args.steps or 4, 1, args.repeats or 1, 2
        args.kills = 0 if args.kills is None else args.kills
    args.methods = [m for m in (DEFAULT_METHODS if args.methods is None else args.methods).split(",") if m]
    for name in args.methods:
        try:
            _method(name)
        except ValueError as exc:
            parser.error(str(exc))
    args.repeats = args.repeats or 3
    args.steps = args.steps or 100
    args.kills = 3 if args.kills is None else args.kills
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return 0
    harness.exit_on_sigterm()
    parameters = harness.count_parameters(args.widths)
    print(
        f"MLP {'-'.join(map(str, args.widths))}: {parameters:,} parameters; {args.workers} processes on gloo, "
        f"{os.cpu_count()} CPU cores",
        flush=True,
    )
    body: dict[str, Any] = {"command": harness.command_line(__file__, argv), "parameters": parameters}
    tables = []
    if args.methods:
        body["cost"] = cost_per_step(args)
        tables.append(render_cost(body["cost"]))
        if args.profile:
            tables.append(render_profiles(body["cost"]))
        print("\n" + "\n\n".join(tables) + "\n", flush=True)
    if args.kills:
        body["kills"] = kill_to_first_step(args)
        tables.append(render_kills(body["kills"]))
        print("\n" + tables[-1], flush=True)
        if body["kills"]["exit_code"] != 0 or not body["kills"]["finished"]:
            print(f"the job did not end cleanly: see {body['kills']['log']}")
            return 1
    harness.write_outputs(args.out, body, "\n\n".join(tables), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
