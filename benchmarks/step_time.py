"""Median wall time of one optimizer step: Lightning's ``ddp`` against ``DecentralizedStrategy``.

One command regenerates the table in ``docs/benchmarks.md``::

    python benchmarks/step_time.py                 # every method, 5 repeats of 5 warm-up + 30 measured steps
    python benchmarks/step_time.py --smoke         # 2 steps, tiny model, 2 methods (< 1 minute)
    python benchmarks/step_time.py --methods ddp,ring,one_peer_exponential --steps 50 --out table.md --out table.json

Every method trains the same MLP (same widths, same per-rank synthetic data, SGD with momentum)
for ``--warmup + --steps`` optimizer steps on ``--workers`` CPU processes over gloo, one method
after another in the same run; the whole list runs ``--repeats`` times, each time in a rotated
order, so slow drift of the machine does not land on one method. Each method run gets its own
group of processes (forked by default, so they do not re-import torch and lightning), started
with the environment Lightning's launcher gives its children (``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``), so ``Trainer(devices=n)`` joins instead of
launching. Each process uses ``--threads`` torch threads (default 1).

Timing: a callback takes ``time.perf_counter()`` at every ``on_train_batch_end``; the time of
step ``k`` is the interval between the ends of steps ``k - 1`` and ``k`` (forward, backward,
communication, optimizer step, fetching the batch: everything a training run pays per step).
The first ``--warmup`` steps are dropped; for each remaining step the slowest rank's time is
taken, and the table shows the median (and the interquartile range) of those per-step maxima,
pooled over the repeats; also each repeat's median, and the mean step (measured wall time /
steps on the slowest rank, the throughput view).

Two rows measure no communication at all, so the reader can see what bounds the others:

* ``single``: one process alone, ``Trainer(devices=1)``, the same steps: compute with a core to itself.
* ``no_exchange`` (the floor; ``local`` is the same method's older name): ``--workers`` processes of
  ``DecentralizedStrategy(topology="ring")`` with ``gossip_every`` larger than the run, so every step
  is local: the strategy's own step (its hooks, the flat parameters, the same processes sharing the same cores) minus
  the exchange. No communication method can step faster; each row's ``overhead`` is ``step / floor − 1``.

Bytes each rank sends per step:

* dpsgd over point-to-point (``ring``, ``torus``, ``exponential``, ``one_peer_exponential``):
  the bytes the strategy's exchange observer reports (``ExchangeEvent.bytes_sent``), i.e. model bytes x the number of
  out-neighbours of ``W(step)``, averaged over the measured steps.
* ``complete`` (one all-reduce of the parameters) and ``ddp`` (all-reduce of the gradients): the
  ring all-reduce figure ``2 (n - 1) / n`` x model bytes. This is a model of the traffic, not a
  count: gloo picks its own all-reduce algorithm. (``Gossip.bytes_sent`` counts an all-reduce as
  one copy of the buffer; the JSON output keeps that figure too.) Any step whose ``W`` is the
  exact average (e.g. ``ring`` on 2 or 3 processes) is counted the same way.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import harness
import lightning.pytorch as pl
import torch
from mlp import MLP, StepClock, make_loader, quiet_trainer

from lightning_decentral import DecentralizedStrategy
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver

# -- what is measured ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str  # the token --methods takes
    label: str  # the table's "method" column
    topology: str  # the table's "topology" column
    strategy: str  # "ddp", "dpsgd", "local" or "single"
    combine: str = "awc"
    dpsgd_topology: str = "ring"
    momentum: str = "local"  # "decentlam" for DecentLaM


METHODS = {
    m.name: m
    for m in (
        Method("ddp", "ddp", "all-reduce (gradients)", "ddp"),
        Method("ring", "dpsgd awc", "ring", "dpsgd", "awc", "ring"),
        Method("torus", "dpsgd awc", "torus", "dpsgd", "awc", "torus"),
        Method("exponential", "dpsgd awc", "exponential", "dpsgd", "awc", "exponential"),
        Method("one_peer_exponential", "dpsgd awc", "one_peer_exponential", "dpsgd", "awc", "one_peer_exponential"),
        Method("complete", "dpsgd awc", "complete", "dpsgd", "awc", "complete"),
        Method("ring_atc", "dpsgd atc", "ring", "dpsgd", "atc", "ring"),
        Method("decentlam_ring", "decentlam", "ring", "dpsgd", "awc", "ring", "decentlam"),
        Method(
            "decentlam_one_peer",
            "decentlam",
            "one_peer_exponential",
            "dpsgd",
            "awc",
            "one_peer_exponential",
            "decentlam",
        ),
        Method("no_exchange", "no exchange (floor)", "none (local steps only)", "local"),
        Method("single", "1 process", "none (compute only)", "single"),
    )
}
ALIASES = {"local": "no_exchange"}  # older names of methods
DEFAULT_METHODS = ",".join(METHODS)
SMOKE_METHODS = "ddp,ring"


class ByteClock(StepClock):
    """[`StepClock`][mlp.StepClock], and the bytes each step's exchanges send (the strategy's exchange observer)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: list[int] = []  # bytes posted per step, all rounds and buckets
        self.all_reduce: list[bool] = []  # W(step) = 11ᵀ/n: the gossip is one all-reduce

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        clock = self

        class Bytes(ExchangeObserver):
            def on_post(self, event: ExchangeEvent) -> None:
                clock.bytes[-1] += event.bytes_sent

        if isinstance(trainer.strategy, DecentralizedStrategy):
            trainer.strategy.observe(Bytes())

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        # Callbacks run before the strategy's own hook, so AWC posts its exchange after this stamp.
        super().on_train_batch_start(trainer, module, batch, batch_idx)
        strategy = trainer.strategy
        if isinstance(strategy, DecentralizedStrategy):
            step = trainer.global_step
            self.bytes.append(0)
            self.all_reduce.append(strategy.gossip_rounds(step) > 0 and strategy.topology.is_average(step))


# -- one rank ------------------------------------------------------------------------------------


def _train(method: Method, config: dict[str, Any], rank: int) -> dict[str, Any]:
    """One rank of one method: train, and return this rank's step times (and bytes)."""
    harness.use_threads(config["threads"])
    harness.quiet()
    world_size = int(os.environ["WORLD_SIZE"])
    widths = tuple(config["widths"])
    total = config["warmup"] + config["steps"]
    if method.strategy == "ddp":
        strategy: Any = "ddp"
    elif method.strategy == "dpsgd":
        strategy = DecentralizedStrategy(
            topology=method.dpsgd_topology, combine=method.combine, momentum=method.momentum
        )
    elif method.strategy == "local":  # (k + 1) % gossip_every is never 0 in this run: every step is local
        strategy = DecentralizedStrategy(topology=method.dpsgd_topology, gossip_every=total + 1)
    else:
        strategy = "auto"
    clock = ByteClock()
    trainer = quiet_trainer(
        strategy, total, [clock], devices=world_size, use_distributed_sampler=False, num_sanity_val_steps=0
    )
    module = MLP(widths, config["lr"], config["momentum"])
    trainer.fit(module, train_dataloaders=make_loader(rank, widths, config["batch_size"], total))
    if len(clock.ends) != total:
        raise RuntimeError(f"expected {total} optimizer steps, the callback saw {len(clock.ends)}")
    return {
        "starts": clock.starts,
        "ends": clock.ends,
        "bytes": clock.bytes,
        "all_reduce": clock.all_reduce,
        "parameters": sum(p.numel() for p in module.parameters()),
        "threads": torch.get_num_threads(),
    }


# -- the driver ------------------------------------------------------------------------------------


class OtherLoad:
    """CPU seconds spent by processes other than this benchmark while a block runs (Linux; else None).

    Busy time of the whole machine from ``/proc/stat``, minus what this process and its reaped
    workers used (``getrusage``). A few tenths of a second is noise; more means something else was
    running and the figures of that run are suspect.
    """

    def __enter__(self) -> OtherLoad:
        self.seconds: float | None = None
        self._start = self._sample()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._sample()
        if self._start is not None and end is not None:
            self.seconds = max(0.0, (end[0] - self._start[0]) - (end[1] - self._start[1]))

    @staticmethod
    def _sample() -> tuple[float, float] | None:
        try:
            import resource

            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
            busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal, without guest
            ours = sum(
                u.ru_utime + u.ru_stime
                for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
            )
            return busy, ours
        except (OSError, ValueError, ImportError, IndexError):
            return None


def _measure(records: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """The step times of one run of one method (all its ranks)."""
    warmup, steps = config["warmup"], config["steps"]
    measured = range(warmup, warmup + steps)
    # step k (k >= 1) takes ends[k] - ends[k-1]; keep the measured ones, the slowest rank per step
    per_rank = [[r["ends"][k] - r["ends"][k - 1] for k in measured] for r in records]
    return {
        "slowest": [max(column) for column in zip(*per_rank)],
        # batch start -> batch end only (leaves out fetching the batch), slowest rank
        "inside": [max(r["ends"][k] - r["starts"][k] for r in records) for k in measured],
        # throughput view: the measured steps' total wall time / steps, slowest rank (insensitive to jitter)
        "mean": max((r["ends"][warmup + steps - 1] - r["ends"][warmup - 1]) / steps for r in records),
        "per_rank_median": [statistics.median(times) for times in per_rank],
        "bytes": [max(r["bytes"][k] for r in records) for k in measured] if all(r["bytes"] for r in records) else None,
        "all_reduce": [records[0]["all_reduce"][k] for k in measured] if records[0]["bytes"] else None,
    }


def _summarize(
    method: Method, runs: list[dict[str, Any]], ranks: int, parameters: int, world_size: int
) -> dict[str, Any]:
    """One table row from every repeat of one method: the measured steps of all repeats pooled."""
    slowest = [t for run in runs for t in run["slowest"]]
    inside = [t for run in runs for t in run["inside"]]
    model_bytes = parameters * 4  # float32
    ring_allreduce = 2 * (world_size - 1) / world_size * model_bytes
    gossip_counted: float | None = None
    sent: float | None = None
    if method.strategy in ("dpsgd", "local") and all(run["bytes"] for run in runs):
        steps = [(b, a) for run in runs for b, a in zip(run["bytes"], run["all_reduce"])]
        gossip_counted = statistics.mean(b for b, _ in steps)
        # an all-reduce step (W = 11ᵀ/n, e.g. `complete`) is counted with the ring model, the others as bytes_sent
        sent = statistics.mean(ring_allreduce if a else b for b, a in steps)
        kinds = {a for _, a in steps}
    if method.strategy == "ddp":
        sent, how = ring_allreduce, "2(n-1)/n x gradient bytes (ring all-reduce model)"
    elif method.strategy == "single":
        sent, how = 0.0, "none"
    elif gossip_counted is None:
        how = "n/a (no byte count recorded)"
    elif method.strategy == "local":
        how = "Gossip.bytes_sent (every step local)"
    elif kinds == {True}:
        how = "2(n-1)/n x model bytes (ring all-reduce model)"
    elif kinds == {False}:
        how = "Gossip.bytes_sent: model bytes x out-neighbours"
    else:
        how = "mean over steps: Gossip.bytes_sent, or 2(n-1)/n x model bytes on all-reduce steps"
    repeat_medians = [statistics.median(run["slowest"]) for run in runs]
    other = [run["other_cpu_s"] for run in runs]
    return {
        "name": method.name,
        "method": method.label,
        "topology": method.topology,
        "ranks": ranks,
        "median_s": statistics.median(slowest),
        "q25_s": harness.quantile(slowest, 0.25),
        "q75_s": harness.quantile(slowest, 0.75),
        "repeat_medians_s": repeat_medians,
        "other_cpu_s": other,
        "wall_s": [run["wall_s"] for run in runs],
        "mean_s": statistics.mean(run["mean"] for run in runs),
        "median_batch_start_to_end_s": statistics.median(inside),
        "median_per_rank_s": [run["per_rank_median"] for run in runs],
        "step_times_slowest_rank_s": [run["slowest"] for run in runs],
        "bytes_sent_per_rank": sent,
        "bytes_how": how,
        "gossip_bytes_sent_reported": gossip_counted,
        "parameters": parameters,
    }


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    if value < 1e5:
        return f"{value / 1e3:.1f} kB"
    return f"{value / 1e6:.1f} MB"


def _fmt_other(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{max(known):.1f}" if known else "n/a"


def render_table(rows: list[dict[str, Any]]) -> str:
    ddp = next((r for r in rows if r["name"] == "ddp"), None)
    floor = next((r for r in rows if r["name"] == "no_exchange"), None)
    lines = [
        "| method | topology | processes | median step (s) | IQR of steps (s) | median of each repeat (s) "
        "| ratio to ddp | overhead (step / floor − 1) | mean step (s) | ratio to ddp (mean) | sent per rank per step "
        "| how the bytes are counted | other CPU s, worst run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['median_s'] / ddp['median_s']:.2f}" if ddp else "n/a"
        overhead = f"{r['median_s'] / floor['median_s'] - 1:+.2f}" if floor else "n/a"
        mean_ratio = f"{r['mean_s'] / ddp['mean_s']:.2f}" if ddp else "n/a"
        lines.append(
            f"| {r['method']} | {r['topology']} | {r['ranks']} | {r['median_s']:.3f} | "
            f"{r['q25_s']:.3f}–{r['q75_s']:.3f} | {min(r['repeat_medians_s']):.3f}–{max(r['repeat_medians_s']):.3f} "
            f"| {ratio} | {overhead} | {r['mean_s']:.3f} | {mean_ratio} | {_fmt_bytes(r['bytes_sent_per_rank'])} "
            f"| {r['bytes_how']} | {_fmt_other(r['other_cpu_s'])} |"
        )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="measured optimizer steps per method (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped before measuring, >= 1 (default 5)")
    parser.add_argument("--workers", type=int, default=4, help="processes per distributed method (default 4)")
    parser.add_argument("--methods", default=None, help=f"comma-separated, from: {DEFAULT_METHODS} (default: all)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="run the method list this many times, each time in a rotated order, and pool the measured steps "
        "(default 5; --smoke: 1)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--widths", default=None, help="MLP widths, e.g. 1024,2048,1024,1024,10 (the default)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument(
        "--start-method",
        choices=("fork", "spawn"),
        default=harness.START_METHOD,
        help="how the worker processes start (default fork: they inherit the imported torch and lightning; "
        "the driver itself never computes, so no thread pool is forked)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per method (default 600)")
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="2 steps, tiny model, methods ddp,ring")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 2 if args.steps is None else args.steps
        args.repeats = 1 if args.repeats is None else args.repeats
        args.warmup = 1 if args.warmup is None else args.warmup
        args.methods = SMOKE_METHODS if args.methods is None else args.methods
    args.steps = 30 if args.steps is None else args.steps
    args.warmup = 5 if args.warmup is None else args.warmup
    args.repeats = 5 if args.repeats is None else args.repeats
    args.methods = DEFAULT_METHODS if args.methods is None else args.methods
    args.widths = harness.parse_widths(args.widths, args.smoke)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (a step's time is measured from the end of the previous one)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.workers < 2:
        parser.error("--workers must be >= 2")
    args.methods = ",".join(ALIASES.get(m, m) for m in args.methods.split(","))
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {DEFAULT_METHODS}")
    if len(args.widths) < 2:
        parser.error("--widths needs at least an input and an output width")
    return args


def _git_state() -> str | None:
    """``<commit>`` of the checkout, ``+ uncommitted changes in lightning_decentral/`` if any."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "lightning_decentral"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit.stdout.strip() + (" + uncommitted changes in lightning_decentral/" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    harness.exit_on_sigterm()
    config = dict(
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        threads=args.threads,
        widths=list(args.widths),
        lr=args.lr,
        momentum=args.momentum,
    )
    methods = [METHODS[m] for m in args.methods.split(",")]
    parameters = harness.count_parameters(args.widths)
    print(
        f"MLP {'-'.join(map(str, args.widths))}: {parameters:,} parameters ({parameters * 4 / 1e6:.1f} MB float32); "
        f"SGD(lr={args.lr}, momentum={args.momentum}); batch {args.batch_size} per process; {args.warmup} warm-up + "
        f"{args.steps} measured steps, {args.repeats} repeat(s); {args.workers} processes on gloo; {args.threads} "
        f"torch thread(s) per process; {os.cpu_count()} CPU cores; torch {torch.__version__}; lightning "
        f"{pl.__version__}; code {_git_state()}",
        flush=True,
    )
    torus_fits = any(args.workers % r == 0 for r in range(2, args.workers // 2 + 1))
    for method in [m for m in methods if m.dpsgd_topology == "torus" and m.strategy == "dpsgd" and not torus_fits]:
        print(f"  {method.name}: skipped, {args.workers} processes do not make a torus", flush=True)
        methods.remove(method)
    with OtherLoad() as before:  # is the machine quiet? (the load average lags by minutes)
        time.sleep(1.0)
    if before.seconds is not None:
        print(
            f"CPU used by other processes in the second before starting: {before.seconds:.2f} s"
            + ("  -- the machine is busy; figures will be noisy" if before.seconds > 0.3 else ""),
            flush=True,
        )
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    ranks: dict[str, int] = {}
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]  # rotate: no method always first
        for method in order:
            t0 = time.monotonic()
            with OtherLoad() as other:
                records = harness.run_ranks(
                    functools.partial(_train, method, config),
                    1 if method.strategy == "single" else args.workers,
                    timeout=args.timeout,
                    one_node=True,
                    start_method=args.start_method,
                )
            if records[0]["parameters"] != parameters:
                raise RuntimeError(f"the model has {records[0]['parameters']} parameters, expected {parameters}")
            run = _measure(records, config)
            run["wall_s"] = time.monotonic() - t0
            run["other_cpu_s"] = other.seconds
            runs[method.name].append(run)
            ranks[method.name] = len(records)
            print(
                f"  repeat {repeat + 1}/{args.repeats}  {method.name:<22} median "
                f"{statistics.median(run['slowest']):.4f} s/step  ({run['wall_s']:.1f} s"
                + ("" if other.seconds is None else f", other processes used {other.seconds:.1f} CPU s")
                + ")",
                flush=True,
            )
    rows = [_summarize(m, runs[m.name], ranks[m.name], parameters, args.workers) for m in methods]
    elapsed = time.monotonic() - started
    table = render_table(rows)
    print()
    print(table)
    print(f"\nwhole run: {elapsed:.0f} s")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "code": _git_state(),
        "backend": "gloo",
        "widths": list(args.widths),
        "parameters": parameters,
        "config": config,
        "repeats": args.repeats,
        "workers": args.workers,
        "start_method": args.start_method,
        "elapsed_s": elapsed,
        "other_cpu_s_in_the_second_before": before.seconds,
    }
    harness.write_outputs(args.out, {"meta": meta, "rows": rows}, table, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
