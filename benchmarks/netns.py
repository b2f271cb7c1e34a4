"""Slow-network benchmark: DDP against gossip with every worker on its own emulated host.

One command regenerates the tables in ``docs/benchmarks.md`` (as root, Linux)::

    python benchmarks/netns.py                      # profiles 1gbit and 10gbit, 3 repeats
    python benchmarks/netns.py --smoke              # 2 steps of each job on a tiny model
    python benchmarks/netns.py --profiles 100mbit --repeats 5 --out table.md --out results.json

The emulated network: ``--workers`` network namespaces ``ldn<pid>-h<i>`` (the hosts), each with
one interface ``eth0`` (10.77.0.<i+1>/24), the other end of whose veth pair sits on a bridge in a
further namespace ``ldn<pid>-hub`` (the switch). Nothing connects to the root namespace, so no
packet can leave the emulated network. Each link is shaped on both of its egress sides, the
host's ``eth0`` (what the host sends) and the switch port (what it receives), with ``tc netem
delay d/2 rate R`` where the kernel has ``sch_netem``; where it has not (this machine's kernel
is built without it), with ``tc tbf rate R`` only, and the tables say that no delay was added.
So a host sends and receives at most ``R`` each way, and two senders to one host share its
``R``, as on a switch. Everything is torn down in ``finally`` (also on Ctrl-C and SIGTERM);
``--cleanup`` removes namespaces left by a run that was killed with SIGKILL.

The network (``harness.EmulatedNetwork``) is shared with ``timeline.py`` and ``cost_model.py``.
Each profile gets one fresh group of worker processes, one per host (``harness.run_ranks``): forked
from this script (so torch and lightning are imported once), each moves into its host's namespace
(``setns``, what ``ip netns exec`` does) and takes the environment Lightning's launcher gives its
children (``MASTER_ADDR`` = host 0's address, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK`` =
host index, ``LOCAL_RANK=0``) and ``GLOO_SOCKET_IFNAME=eth0``,
so ``Trainer(num_nodes=n, devices=1)`` joins as on a real cluster. The workers then run every
job of the profile one ``Trainer.fit`` after another in the same process group, the method
order rotated from repeat to repeat:

* **step time**: the MLP and data of ``benchmarks/step_time.py`` (its ``--widths``), SGD with
  momentum; the time of step ``k`` is the gap between the ends of steps ``k - 1`` and ``k`` on
  the slowest rank (as in step_time.py); warm-up steps dropped.
* ``ddp_powersgd``: DDP whose gradient buckets are all-reduced as rank-4 factors ``P`` and ``Q`` of each matrix,
  with error feedback: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=4, start_powerSGD_iter=2)``
  (``torch.distributed.algorithms.ddp_comm_hooks``; the first two steps all-reduce plainly, inside the warm-up),
  registered on the Trainer's ``DistributedDataParallel`` when training starts: Lightning's
  ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers it on CUDA only and ignores it on the CPU. The
  gradients travel in one bucket (``bucket_cap_mb=1024``): with DDP's default 25 MB buckets gloo aborted the job
  ("Received data size doesn't match expected size. Is there a distributed collective mismatch"; the hook issues
  each bucket's next all-reduce from the previous one's callback, an order that may differ between ranks).
* ``one_peer_sign_overlap``: ``one_peer_sign`` with ``compression_overlap=True``: the CHOCO arithmetic on the mixer's
  helper thread during forward and backward instead of the training thread (the encode before the forward pass, the
  decode after backward); list both in one run for the A/B (the repeats rotate the order).
* ``no_exchange``: the floor, ``DecentralizedStrategy(topology="ring")`` (static: any ``gossip_every`` is allowed)
  with ``gossip_every`` beyond the run: the strategy's own step with every step local, nothing sent. Each method's
  ``overhead`` is its step over the floor's in the same repeat, minus 1 (the time it adds to the computation).
* ``decent_dp``: Decent-DP (``pip install decent-dp``; not a dependency of this project), its
  ``DecentralizedDataParallel`` with ``topology="one-peer-exp"`` around the same MLP, in a plain loop of its own (it
  steps the optimizer in its backward hooks, so it cannot run under a Lightning ``Trainer``); step-time job only.
* **the exchange on the training thread**: the time the training thread spends inside the exchanges' ``start`` and
  ``wait`` in a step (``ExchangeEvent``), the median over the measured steps, the median rank's: with
  ``compression_overlap`` the CHOCO arithmetic leaves it for the mixer's helper thread (a line under the table).
* **bytes on the wire**: each host's ``eth0`` transmit counter (``/proc/net/dev`` inside its namespace) at the end of
  every step; per rank and step, the growth over the measured steps (everything the rank sent: gradients or models,
  gloo's own messages, TCP/IP headers).
* **time to loss**: ``DigitsCNN`` on ``DigitsDataModule`` (``examples/digits.py``), each rank a
  shard; the wall-clock time from a common start (a barrier) until the training loss, averaged
  over the ranks and over the last ``--smooth`` steps, first falls below ``--threshold``. The
  losses and times are recorded per rank and combined afterwards, so measuring adds no
  communication to the run.

Every figure is also given as a ratio to ``ddp`` measured in the same run (same profile, same
processes, interleaved).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

import harness

# -- the benchmark's jobs (run inside each worker) ---------------------------------------------------

# the methods of the issues: name -> (table label, topology (None: DDP's all-reduce), momentum, compression)
METHODS = {
    "no_exchange": ("no exchange (floor)", "none (local steps only)", "local", None),
    "ddp": ("ddp", None, None, None),
    "ring": ("dpsgd awc", "ring", "local", None),
    "one_peer_exponential": ("dpsgd awc", "one_peer_exponential", "local", None),
    "decentlam": ("decentlam", "ring", "decentlam", None),
    "decentlam_one_peer": ("decentlam", "one_peer_exponential", "decentlam", None),
    # compression keeps a public copy per edge and refuses a time-varying graph: one peer a step on a static ring
    "one_peer_sign": ("dpsgd awc, sign", "one_peer_ring", "local", "sign"),
    "one_peer_sign_overlap": ("dpsgd awc, sign, compression_overlap=True", "one_peer_ring", "local", "sign"),
    "one_peer_int4": ("dpsgd awc, int4", "one_peer_ring", "local", "int4"),
    "one_peer_top_k": ("dpsgd awc, top_k:0.01", "one_peer_ring", "local", "top_k:0.01"),
    "ddp_powersgd": ("ddp + PowerSGD (rank 4)", "all-reduce (rank-4 factors of the gradients)", None, None),
    "decent_dp": ("Decent-DP 0.2.3", "one-peer-exp (its own)", None, None),
}
POWERSGD_RANK = 4
POWERSGD_BUCKET_MB = 1024  # one bucket (see the module's docstring)
STEPS_ONLY = ("decent_dp",)  # methods without a time-to-loss job
OVERLAP = ("one_peer_sign_overlap",)  # compression_overlap=True: the CHOCO arithmetic on the mixer's helper thread
DEFAULT_METHODS = "ddp,ring,one_peer_exponential,decentlam"


def make_strategy(method: str, max_steps: int) -> Any:
    from lightning_decentral import DecentralizedStrategy

    _, topology, momentum, compression = METHODS[method]
    if method == "no_exchange":  # (k + 1) % gossip_every is never 0 in the run: every step local, nothing sent
        return DecentralizedStrategy(topology="ring", gossip_every=max_steps + 1)
    if method == "ddp_powersgd":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(bucket_cap_mb=POWERSGD_BUCKET_MB)
    if topology is None:
        return "ddp"
    overlap = {"compression_overlap": True} if method in OVERLAP else {}
    return DecentralizedStrategy(topology=topology, momentum=momentum, compression=compression, **overlap)


def register_powersgd(trainer: Any) -> None:
    """PowerSGD's comm hook on the Trainer's ``DistributedDataParallel`` (before the first backward).
    ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` would register it only on CUDA (Lightning 2.6's
    ``DDPStrategy._register_ddp_hooks``), and gloo runs it as well."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2)
    trainer.strategy.model.register_comm_hook(state, powersgd.powerSGD_hook)


def make_trainer(method: str, world_size: int, max_steps: int, callbacks: list, **kwargs: Any) -> Any:
    import lightning.pytorch as pl
    from mlp import quiet_trainer

    class PowerSGD(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            register_powersgd(trainer)

    if method == "ddp_powersgd":
        callbacks = [PowerSGD(), *callbacks]
    return quiet_trainer(
        make_strategy(method, max_steps),
        max_steps,
        callbacks,
        num_nodes=world_size,
        devices=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def sent_bytes() -> int:
    """What this rank's interface has transmitted (``eth0`` on the emulated network, else ``lo``)."""
    return harness.interface_bytes(os.environ.get("GLOO_SOCKET_IFNAME", "lo"))[1]


def _step_time_job(method: str, config: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from mlp import MLP, StepClock, make_loader

    widths = tuple(config["widths"])
    total = config["warmup"] + config["steps"]
    loader = make_loader(rank, widths, config["batch_size"], total)
    if method == "decent_dp":
        return _decent_dp_steps(widths, loader)
    from lightning_decentral import DecentralizedStrategy
    from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver

    clock, sent = StepClock(), []
    calls: list[tuple[int, float]] = []  # (step, seconds the training thread spent inside an exchange's start or wait)

    class Calls(ExchangeObserver):
        def on_post(self, event: ExchangeEvent) -> None:
            calls.append((event.step, event.posted - event.post_started))

        def on_wait(self, event: ExchangeEvent) -> None:
            assert event.waited is not None and event.wait_started is not None
            calls.append((event.step, event.waited - event.wait_started))

    class Sent(pl.Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            if isinstance(trainer.strategy, DecentralizedStrategy):
                trainer.strategy.observe(Calls())

        def on_train_batch_end(self, *args: Any) -> None:
            sent.append(sent_bytes())

    trainer = make_trainer(method, world_size, total, [clock, Sent()], use_distributed_sampler=False)
    module = MLP(widths, lr=0.01, momentum=0.9)
    trainer.fit(module, train_dataloaders=loader)
    per_step: dict[int, float] = {}
    for step, seconds in calls:
        if step >= config["warmup"]:
            per_step[step] = per_step.get(step, 0.0) + seconds
    inside = statistics.median(per_step.values()) if per_step else 0.0
    return {"ends": clock.ends, "sent": sent, "exchange_calls_s": inside}


def _decent_dp_steps(widths: tuple[int, ...], loader: Any) -> dict[str, Any]:
    """Decent-DP's own loop: forward, backward (which steps and gossips, bucket by bucket), the clock."""
    import torch
    import torch.distributed as dist
    from decent_dp.ddp import DecentralizedDataParallel
    from loguru import logger
    from mlp import MLP

    logger.remove()  # its debug lines
    if not dist.is_initialized():  # the environment harness.run_ranks gives: MASTER_ADDR, RANK, WORLD_SIZE...
        dist.init_process_group("gloo")
    net = MLP(widths, lr=0.01, momentum=0.9).net  # the same initial model (seed 0)
    model = DecentralizedDataParallel(
        net,
        optim_fn=lambda named: torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9),
        topology="one-peer-exp",
    )
    ends, sent = [], []
    for x, y in loader:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        ends.append(time.perf_counter())
        sent.append(sent_bytes())
    return {"ends": ends, "sent": sent}


def _time_to_loss_job(method: str, config: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    digits = harness.import_example("digits")  # examples/digits.py

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.start = 0.0
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_train_start(self, trainer: Any, module: Any) -> None:
            trainer.strategy.barrier()  # a common start; nothing is communicated while timing
            self.start = time.monotonic()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.monotonic())
            self.losses.append(float(outputs["loss"]))

    record = Record()
    torch.manual_seed(0)
    trainer = make_trainer(method, world_size, config["digits_steps"], [record])
    trainer.fit(
        digits.DigitsCNN(lr=config["digits_lr"]), datamodule=digits.DigitsDataModule(batch_size=config["digits_batch"])
    )
    return {"start": record.start, "ends": record.ends, "losses": record.losses}


JOBS = {"steps": _step_time_job, "loss": _time_to_loss_job}


def _work(spec: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """One worker: every job of ``spec`` in order, in one process group."""
    harness.use_threads(spec["config"]["threads"])
    harness.quiet()
    world_size = int(os.environ["WORLD_SIZE"])
    return [{**job, **JOBS[job["kind"]](job["method"], spec["config"], rank, world_size)} for job in spec["jobs"]]


# -- the driver ----------------------------------------------------------------------------------


def time_to_loss(records: list[dict[str, Any]], threshold: float, smooth: int) -> tuple[float | None, int | None]:
    """Seconds (from the common start) and steps until the rank-mean loss, averaged over the last
    ``smooth`` steps, first falls below ``threshold``; ``(None, None)`` if it never does."""
    start = min(r["start"] for r in records)
    steps = min(len(r["losses"]) for r in records)
    mean = [statistics.fmean(r["losses"][k] for r in records) for k in range(steps)]
    for k in range(smooth - 1, steps):
        if statistics.fmean(mean[k - smooth + 1 : k + 1]) < threshold:
            return max(r["ends"][k] for r in records) - start, k + 1
    return None, None


def _jobs(methods: list[str], repeats: int, kinds: list[str]) -> list[dict[str, Any]]:
    jobs = []
    for repeat in range(repeats):
        order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]  # no method always first
        jobs += [{"kind": kind, "method": m, "repeat": repeat} for kind in kinds for m in order]
    return jobs


def summarize(profile: dict[str, Any], methods: list[str], config: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: step time and time to loss, pooled over repeats, and ratios to ddp."""
    by = {(job["kind"], job["method"], job["repeat"]): job for job in profile["jobs"]}
    repeats = sorted({job["repeat"] for job in profile["jobs"]})
    rows = []
    for m in methods:
        row: dict[str, Any] = {
            "name": m,
            "method": METHODS[m][0],
            "topology": METHODS[m][1] or "all-reduce (gradients)",
        }
        if ("steps", m, 0) in by:
            row["sent_per_step"] = statistics.median(by[("steps", m, r)]["sent_per_step"] for r in repeats)
            pooled = [t for r in repeats for t in by[("steps", m, r)]["step_s"]]
            row["step_median_s"], row["step_q25_s"], row["step_q75_s"] = (
                statistics.median(pooled),
                harness.quantile(pooled, 0.25),
                harness.quantile(pooled, 0.75),
            )
            row["step_repeat_medians_s"] = [statistics.median(by[("steps", m, r)]["step_s"]) for r in repeats]
            row["exchange_calls_s"] = [by[("steps", m, r)].get("exchange_calls_s", 0.0) for r in repeats]
        if ("loss", m, 0) in by:
            row["loss_s"] = [by[("loss", m, r)]["time_to_loss_s"] for r in repeats]
            row["loss_steps"] = [by[("loss", m, r)]["steps_to_loss"] for r in repeats]
            row["final_loss"] = [
                statistics.fmean(by[("loss", m, r)]["mean_loss"][-config["smooth"] :]) for r in repeats
            ]
        rows.append(row)
    ddp = next((r for r in rows if r["name"] == "ddp"), None)
    floor = next((r for r in rows if r["name"] == "no_exchange"), None)
    for row in rows:
        if ddp and "step_median_s" in row:
            # per repeat: this method's median over ddp's median in the same repeat
            row["step_ratio"] = [a / b for a, b in zip(row["step_repeat_medians_s"], ddp["step_repeat_medians_s"])]
        if floor and "step_median_s" in row and "step_median_s" in floor:
            # per repeat: this method's median over the floor's in the same repeat, minus 1
            row["overhead"] = [a / b - 1 for a, b in zip(row["step_repeat_medians_s"], floor["step_repeat_medians_s"])]
        if ddp and "loss_s" in row:
            row["loss_ratio"] = [a / b for a, b in zip(row["loss_s"], ddp["loss_s"]) if a is not None and b is not None]
    return rows


def render(profile: dict[str, Any], rows: list[dict[str, Any]], config: dict[str, Any], command: str) -> str:
    link = profile["link"]
    lines = [
        f"**{link['name']}**: {profile['shaping']}; measured TCP goodput host 0 → host 1: "
        f"{profile['goodput_gbit']:.2f} Gbit/s. Command: `{command}`",
        "",
        "| method | topology | sent per rank and step (MB) | median step (s) | IQR of steps (s) "
        "| step / ddp (median, range over repeats) | overhead: step / floor − 1 (median, range) "
        f"| time to loss < {config['threshold']:g} (s, median) | steps to it (median) | time / ddp (median, range) "
        f"| loss at the end (mean of the last {config['smooth']} steps) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(values: list[float] | None, sign: str = "") -> str:
        if not values:
            return "n/a"
        return f"{statistics.median(values):{sign}.2f} ({min(values):{sign}.2f}–{max(values):{sign}.2f})"

    for r in rows:
        reached = [t for t in r.get("loss_s", []) if t is not None]
        missed = len(r.get("loss_s", [])) - len(reached)
        loss = f"{statistics.median(reached):.2f}" if reached else "not reached"
        if reached and missed:
            loss += f" ({missed} run(s) not reached)"
        steps = [s for s in r.get("loss_steps", []) if s is not None]
        lines.append(
            f"| {r['method']} | {r['topology']} | "
            + (f"{r['sent_per_step'] / 1e6:.2f} | " if "sent_per_step" in r else "n/a | ")
            + (
                f"{r['step_median_s']:.3f} | {r['step_q25_s']:.3f}–{r['step_q75_s']:.3f} | "
                if "step_median_s" in r
                else "n/a | n/a | "
            )
            + f"{ratio(r.get('step_ratio'))} | {ratio(r.get('overhead'), '+')} | {loss if 'loss_s' in r else 'n/a'} | "
            + f"{statistics.median(steps) if steps else 'n/a'} | {ratio(r.get('loss_ratio'))} | "
            + (f"{statistics.median(r['final_loss']):.3f} |" if "final_loss" in r else "n/a |")
        )
    calls = [
        f"{r['method']} {1e3 * statistics.median(r['exchange_calls_s']):.1f} ms"
        for r in rows
        if any(r.get("exchange_calls_s", []))
    ]
    if calls:
        lines += [
            "",
            "The training thread inside the exchanges' `start` and `wait` in a step (median over steps, ranks "
            "and repeats): " + "; ".join(calls) + ".",
        ]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--profiles", default=None, help=f"comma-separated, from {','.join(harness.PROFILES)} (default 1gbit,10gbit)"
    )
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from {','.join(METHODS)}")
    parser.add_argument("--workers", type=int, default=4, help="hosts, one worker each (default 4)")
    parser.add_argument("--repeats", type=int, default=None, help="rotated repeats of the method list (default 3)")
    parser.add_argument("--jobs", default="steps,loss", help="steps (step time), loss (time to loss), or both")
    parser.add_argument("--steps", type=int, default=None, help="measured MLP steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="MLP steps dropped first (default 3)")
    parser.add_argument("--widths", default=None, help="MLP widths (default: step_time.py's, 5.3M parameters)")
    parser.add_argument("--batch-size", type=int, default=32, help="MLP samples per worker per step (default 32)")
    parser.add_argument("--digits-steps", type=int, default=None, help="optimizer steps per digits run (default 100)")
    parser.add_argument("--digits-batch", type=int, default=32, help="digits samples per worker per step")
    parser.add_argument("--digits-lr", type=float, default=0.05)
    parser.add_argument("--threshold", type=float, default=0.5, help="the training loss to reach (default 0.5)")
    parser.add_argument("--smooth", type=int, default=10, help="steps the loss is averaged over (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds allowed per profile (default 480)")
    parser.add_argument("--out", action="append", default=[], help="write results: .md (tables) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="1 profile, tiny MLP, 2 steps per job, ddp and ring")
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs, then exit")
    args = parser.parse_args(argv)
    if args.smoke:
        args.profiles = args.profiles or "1gbit"
        args.methods = "ddp,ring" if args.methods == DEFAULT_METHODS else args.methods
        args.repeats = args.repeats or 1
        args.steps, args.warmup = args.steps or 2, args.warmup or 1
        args.digits_steps = args.digits_steps or 3
        args.smooth = min(args.smooth, 2)
    args.profiles = (args.profiles or "1gbit,10gbit").split(",")
    args.methods = args.methods.split(",")
    args.jobs = args.jobs.split(",")
    args.repeats = args.repeats or 3
    args.steps, args.warmup = args.steps or 10, args.warmup or 3
    args.digits_steps = args.digits_steps or 100
    args.widths = harness.parse_widths(args.widths, args.smoke)
    for name, values, known in (
        ("profiles", args.profiles, harness.PROFILES),
        ("methods", args.methods, METHODS),
        ("jobs", args.jobs, JOBS),
    ):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; choose from {list(known)}")
    if args.workers < 2 or args.workers > 250:
        parser.error("--workers must be between 2 and 250")
    if "loss" in args.jobs and any(m in STEPS_ONLY for m in args.methods):
        parser.error(f"{', '.join(STEPS_ONLY)} run(s) the step-time job only: add --jobs steps")
    if "decent_dp" in args.methods and importlib.util.find_spec("decent_dp") is None:
        parser.error(
            "decent_dp needs Decent-DP, not installed here: pip install decent-dp (with loguru), e.g. with --target "
            "DIR and PYTHONPATH=DIR"
        )
    if "ddp_powersgd" in args.methods and args.warmup < 2:
        parser.error("ddp_powersgd all-reduces its first two steps plainly: use --warmup >= 2")
    if args.warmup < 1 or args.steps < 1 or args.smooth < 1 or args.digits_steps < args.smooth:
        parser.error("--warmup, --steps and --smooth must be >= 1, and --digits-steps >= --smooth")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.cleanup:
        print("removed:", harness.remove_stale_namespaces() or "nothing")
        return 0
    ok, why = harness.netns_permitted()
    if not ok:
        print(f"netns.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    harness.exit_on_sigterm()
    config = dict(
        widths=args.widths,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        threads=args.threads,
        digits_steps=args.digits_steps,
        digits_batch=args.digits_batch,
        digits_lr=args.digits_lr,
        threshold=args.threshold,
        smooth=args.smooth,
    )
    command = harness.command_line(__file__, argv)
    parameters = harness.count_parameters(args.widths)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.workers} hosts; MLP {'-'.join(map(str, args.widths))} ({parameters:,} parameters, "
        f"{parameters * 4 / 1e6:.1f} MB); {args.warmup}+{args.steps} steps, batch {args.batch_size}; digits: "
        f"{args.digits_steps} steps, batch {args.digits_batch}, lr {args.digits_lr}, loss threshold {args.threshold} "
        f"(mean of {args.smooth} steps); {args.repeats} repeat(s); {os.cpu_count()} CPU cores, load average {load:.1f}",
        flush=True,
    )
    harness.import_example("digits")  # imported once here, inherited by the forked workers
    import mlp  # noqa: F401

    results: dict[str, Any] = {"meta": {}, "profiles": []}
    tables = []
    started = time.monotonic()
    for name in args.profiles:
        link = harness.PROFILES[name]
        with harness.EmulatedNetwork(args.workers, link) as network:
            goodput = network.throughput_gbit(0.5 if args.smoke else 1.0)
            print(f"[{name}] {network.shaping}; TCP goodput {goodput:.2f} Gbit/s", flush=True)
            spec = {"config": config, "jobs": _jobs(args.methods, args.repeats, args.jobs)}
            t0 = time.monotonic()
            records = harness.run_ranks(
                functools.partial(_work, spec), args.workers, timeout=args.timeout, network=network
            )
            jobs = []
            for i, job in enumerate(spec["jobs"]):
                per_rank = [r[i] for r in records]
                if job["kind"] == "steps":
                    sent = [(r["sent"][-1] - r["sent"][args.warmup - 1]) / args.steps for r in per_rank]
                    job = {
                        **job,
                        "step_s": harness.step_times(per_rank, args.warmup),
                        "sent_per_step": statistics.fmean(sent),
                        "exchange_calls_s": statistics.median(r.get("exchange_calls_s", 0.0) for r in per_rank),
                    }
                else:
                    seconds, steps = time_to_loss(per_rank, args.threshold, args.smooth)
                    mean_loss = [
                        statistics.fmean(r["losses"][k] for r in per_rank) for k in range(len(per_rank[0]["losses"]))
                    ]
                    job = {**job, "time_to_loss_s": seconds, "steps_to_loss": steps, "mean_loss": mean_loss}
                jobs.append(job)
            profile = {
                "link": asdict(link),
                "shaping": network.shaping,
                "delay_applied": network.delay_applied,
                "goodput_gbit": goodput,
                "wall_s": time.monotonic() - t0,
                "jobs": jobs,
                "namespaces": [*network.namespaces, network.hub],
            }
        rows = summarize(profile, args.methods, config)
        profile["rows"] = rows
        results["profiles"].append(profile)
        tables.append(render(profile, rows, config, command))
        print("\n" + tables[-1] + "\n", flush=True)
    results["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": config,
        "methods": args.methods,
        "workers": args.workers,
        "repeats": args.repeats,
        "parameters": parameters,
        "cpu_cores": os.cpu_count(),
        "load_average_at_start": load,
        "elapsed_s": time.monotonic() - started,
    }
    print(f"whole run: {results['meta']['elapsed_s']:.0f} s")
    harness.write_outputs(args.out, results, "\n\n".join(tables), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
