"""Overlap, shown: per-rank timelines of AWC's and DecentLaM's steps, and step ≈ max(compute, comm).

One command regenerates the table and ``docs/img/benchmarks/timeline.png`` (as root: on the
emulated 1 Gbit/s network of ``benchmarks/netns.py``)::

    python benchmarks/timeline.py
    python benchmarks/timeline.py --network loopback      # no namespaces needed (CPU-bound transport)
    python benchmarks/timeline.py --smoke                 # 2 steps, tiny model, no figure unless --png

On ``--workers`` hosts (one worker each), the same MLP and data as ``benchmarks/step_time.py``
train with ``DecentralizedStrategy(topology=--topology)`` in these runs, one after another in
the same process group:

* **compute only**: ``gossip_every`` larger than the run, so no step communicates;
* **comm only**: no training; the bytes of one step go through ``Gossip`` (``start`` then
  ``wait``) as the run would send them: the whole model for AWC and ATC, ``bucket_cap_mb``
  buckets posted back to back for DecentLaM, after a barrier each time;
* **AWC** (``combine="awc"``): the exchange of ``x(k)`` is posted at batch start and waited
  for after backward;
* **DecentLaM** (``momentum="decentlam"``): each bucket of ``z`` is posted from backward;
* **ATC** (``combine="atc"``): one blocking exchange after the optimizer step, no overlap: the
  reference for compute + comm.

The runs are repeated ``--repeats`` times, each time in a rotated order, so that a drift of the
machine's load does not land on one run. Each step's time is the gap between the ends of steps
``k - 1`` and ``k``, the slowest rank's; the table gives the median over the measured steps of
all repeats, the figure shows the first repeat. The timeline records on every rank, with ``time.perf_counter``
(one clock for all processes of the machine): forward (``training_step``), backward
(``on_before_backward`` → ``on_after_backward``), each ``Gossip.start`` (post) and
``PendingGossip.wait`` (the time a rank is blocked on the network), and the optimizer step.
The bar "in flight" runs from a post to the end of its wait: the bytes travel at some point
inside it. A step that overlaps well has its waits short and its time near
``max(compute, comm)``; ATC's near ``compute + comm``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import harness

RUNS = ("compute_awc", "awc", "compute_decentlam", "decentlam", "atc", "comm_awc", "comm_decentlam")
EVENTS: list[tuple[str, float, float, int]] = []  # (what, begin, end, tag), on this rank


def _recorder() -> Any:
    """An exchange observer that records every post and wait of this rank into ``EVENTS``."""
    from lightning_decentral.mixing import ExchangeObserver

    class Recorder(ExchangeObserver):
        def on_post(self, event: Any) -> None:
            EVENTS.append(("post", event.post_started, event.posted, event.tag))

        def on_wait(self, event: Any) -> None:
            EVENTS.append(("wait", event.wait_started, event.waited, event.tag))

    return Recorder()


def _strategy(run: str, topology: str, total: int) -> Any:
    from lightning_decentral import DecentralizedStrategy

    if run.startswith("compute_"):
        momentum = "decentlam" if run.endswith("decentlam") else "local"  # no step gossips: any static topology
        return DecentralizedStrategy(topology="ring", momentum=momentum, gossip_every=total + 1)
    if run == "decentlam":
        return DecentralizedStrategy(topology=topology, momentum="decentlam")
    return DecentralizedStrategy(topology=topology, combine=run)


def _train(run: str, config: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from mlp import MLP, make_loader, quiet_trainer

    class Stamps(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[tuple[str, float]] = []

        def mark(self, what: str) -> None:
            self.marks.append((what, time.perf_counter()))

        def on_train_batch_start(self, *args: Any) -> None:
            self.mark("batch_start")

        def on_before_backward(self, *args: Any) -> None:
            self.mark("backward_start")

        def on_after_backward(self, *args: Any) -> None:
            self.mark("backward_end")

        def on_train_batch_end(self, *args: Any) -> None:
            self.mark("batch_end")

    class TimedMLP(MLP):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            stamps.mark("forward_start")
            return super().training_step(batch, batch_idx)

    widths = tuple(config["widths"])
    total = config["warmup"] + config["steps"]
    stamps = Stamps()
    trainer = quiet_trainer(
        _strategy(run, config["topology"], total),
        total,
        [stamps],
        num_nodes=world_size,
        devices=1,
        use_distributed_sampler=False,
    )
    EVENTS.clear()
    trainer.strategy.observe(_recorder())
    trainer.fit(
        TimedMLP(widths, lr=0.01, momentum=0.9),
        train_dataloaders=make_loader(rank, widths, config["batch_size"], total),
    )
    ends = [t for what, t in stamps.marks if what == "batch_end"]
    return {"ends": ends, "marks": stamps.marks, "events": list(EVENTS)}


def _communicate(run: str, config: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The bytes of one step through ``Gossip`` alone, ``--steps`` times: seconds from post to last wait."""
    import torch
    import torch.distributed as dist

    from lightning_decentral.gossip import Gossip
    from lightning_decentral.topology import resolve_topology

    gossip = Gossip(resolve_topology(config["topology"], world_size))
    flat = torch.zeros(harness.count_parameters(tuple(config["widths"])))
    cap = int(config["bucket_cap_mb"] * 2**20) // flat.element_size()
    buffers = list(flat.split(cap)) if run == "comm_decentlam" else [flat]
    seconds = []
    for k in range(config["warmup"] + config["steps"]):
        dist.barrier()
        begin = time.perf_counter()
        pending = [gossip.start([b], step=k, tag=i) for i, b in enumerate(buffers)]
        for p in pending:
            p.wait()
        seconds.append(time.perf_counter() - begin)
    return {"seconds": seconds[config["warmup"] :], "buckets": len(buffers)}


def _work(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """One worker: every run of ``spec`` in order, in one process group."""
    harness.use_threads(spec["config"]["threads"])
    harness.quiet()
    world_size = int(os.environ["WORLD_SIZE"])
    results: dict[str, list[dict[str, Any]]] = {run: [] for run in RUNS}
    for repeat in range(spec["config"]["repeats"]):  # rotated: no run always first (the machine drifts)
        for run in RUNS[repeat % len(RUNS) :] + RUNS[: repeat % len(RUNS)]:
            results[run].append(
                (_communicate if run.startswith("comm_") else _train)(run, spec["config"], rank, world_size)
            )
    return results


# -- the driver ----------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Median seconds per step of every run (slowest rank), pooled over the repeats."""
    medians = {}
    for run in RUNS:
        pooled: list[float] = []
        for repeat in range(len(records[0][run])):
            if run.startswith("comm_"):
                pooled += [max(column) for column in zip(*(r[run][repeat]["seconds"] for r in records))]
            else:
                pooled += harness.step_times([r[run][repeat] for r in records], warmup)
        medians[run] = statistics.median(pooled)
    return medians


def render_table(medians: dict[str, float], command: str, setting: str) -> str:
    lines = [
        f"Command: `{command}`; {setting}",
        "",
        "| run | compute only (s) | comm only (s) | compute + comm (s) | max(compute, comm) (s) | measured step (s) "
        "| measured / max | measured / sum |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, run, compute, comm in (
        ("dpsgd awc (overlaps forward + backward)", "awc", "compute_awc", "comm_awc"),
        ("decentlam (overlaps backward, per bucket)", "decentlam", "compute_decentlam", "comm_decentlam"),
        ("dpsgd atc (no overlap)", "atc", "compute_awc", "comm_awc"),
    ):
        c, m, s = medians[compute], medians[comm], medians[run]
        lines.append(
            f"| {label} | {c:.3f} | {m:.3f} | {c + m:.3f} | {max(c, m):.3f} | {s:.3f} | {s / max(c, m):.2f} | "
            f"{s / (c + m):.2f} |"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], warmup: int, shown: int, path: Path, title: str) -> None:
    """Per-rank lanes (compute above, network below) for ``shown`` steps after warm-up, AWC then DecentLaM
    then ATC (the first repeat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {
        "forward": "#4C72B0",
        "backward": "#55A868",
        "optimizer + combine": "#C44E52",
        "in flight": "#CCCCCC",
        "blocked in wait": "#DD8452",
        "post": "#8172B2",
    }
    runs = [
        ("awc", "dpsgd awc: the exchange of x(k) posted at batch start, waited for after backward"),
        ("decentlam", "decentlam: each bucket of z posted from backward (ticks), waited for before the step"),
        ("atc", "dpsgd atc: blocking exchange after the step (no overlap)"),
    ]
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 2.0 + 1.2 * len(records) * len(runs)), squeeze=False)
    span = 0.0  # one time scale for every panel
    for ax, (run, caption) in zip(axes[:, 0], runs):
        starts = [[t for what, t in r[run][0]["marks"] if what == "batch_start"] for r in records]
        ends = [r[run][0]["ends"] for r in records]
        t0 = min(s[warmup] for s in starts)
        t1 = max(e[min(warmup + shown, len(e)) - 1] for e in ends)
        for rank, r in enumerate(records):
            y = (len(records) - 1 - rank) * 2.2
            marks = [(w, t - t0) for w, t in r[run][0]["marks"]]
            segments: dict[str, list[tuple[float, float]]] = {k: [] for k in colors}
            last: dict[str, float] = {}
            for what, t in marks:
                if what == "forward_start":
                    last["forward"] = t
                elif what == "backward_start" and "forward" in last:
                    segments["forward"].append((last.pop("forward"), t))
                    last["backward"] = t
                elif what == "backward_end" and "backward" in last:
                    segments["backward"].append((last.pop("backward"), t))
                    last["after"] = t
                elif what == "batch_end" and "after" in last:
                    last["optimizer"] = last.pop("after")
                    segments["optimizer + combine"].append((last.pop("optimizer"), t))
            posts: dict[int, list[float]] = {}
            for what, begin, end, tag in r[run][0]["events"]:
                begin, end = begin - t0, end - t0
                if what == "post":
                    segments["post"].append((begin, end))
                    posts.setdefault(tag, []).append(end)
                else:
                    segments["blocked in wait"].append((begin, end))
                    if posts.get(tag):
                        segments["in flight"].append((posts[tag].pop(0), end))
            for name, spans in segments.items():
                lane = y + (1.0 if name in ("forward", "backward", "optimizer + combine", "post") else 0.0)
                height = 0.8 if name != "in flight" else 0.35
                spans = [(a, b - a) for a, b in spans if b > -0.05 and a < t1 - t0 + 0.05]
                if spans:
                    ax.broken_barh(spans, (lane + (0.45 if name == "in flight" else 0.0), height), color=colors[name])
            ax.text(-0.01 * (t1 - t0), y + 0.9, f"rank {rank}", ha="right", va="center", fontsize=8)
        span = max(span, t1 - t0)
        ax.set_yticks([])
        ax.set_title(caption, fontsize=9, loc="left")
        ax.set_xlabel("seconds", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_xlim(-0.02 * span, span * 1.02)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper center", ncol=6, fontsize=8)
    fig.suptitle(textwrap.fill(title, 160), fontsize=9, y=0.975)
    fig.tight_layout(rect=(0.03, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--network",
        default="1gbit",
        help=f"loopback, or a netns.py profile: {', '.join(harness.PROFILES)} (default 1gbit)",
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--topology", default="one_peer_exponential", help="the gossip topology (default one_peer_exponential)"
    )
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped first (default 3)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="rotated repeats of all runs, pooled (default 2; --smoke 1)"
    )
    parser.add_argument("--shown", type=int, default=3, help="steps drawn in the timeline (default 3)")
    parser.add_argument("--widths", default=None, help="MLP widths (default: step_time.py's, 5.3M parameters)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per worker per step (default 64)")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=4.0, help="DecentLaM's bucket size (the strategy's default)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=420.0)
    parser.add_argument(
        "--png", default=None, help="the figure (default docs/img/benchmarks/timeline.png; --smoke: none)"
    )
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="2 measured steps on a tiny model")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = args.steps or 2, args.warmup or 1
        args.shown = min(args.shown, 2)
        args.repeats = args.repeats or 1
    elif args.png is None:
        args.png = str(harness.ROOT / "docs" / "img" / "benchmarks" / "timeline.png")
    args.steps, args.warmup, args.repeats = args.steps or 12, args.warmup or 3, args.repeats or 2
    if args.network != "loopback" and args.network not in harness.PROFILES:
        parser.error(f"--network must be loopback or one of {list(harness.PROFILES)}")
    args.widths = harness.parse_widths(args.widths, args.smoke)
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    link = None if args.network == "loopback" else harness.PROFILES[args.network]
    if link is not None:
        ok, why = harness.netns_permitted()
        if not ok:
            print(f"--network {args.network} needs network namespaces: {why}. Use --network loopback.", file=sys.stderr)
            return 2
    harness.exit_on_sigterm()
    command = harness.command_line(__file__, argv)
    config = dict(
        widths=args.widths,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        threads=args.threads,
        topology=args.topology,
        bucket_cap_mb=args.bucket_cap_mb,
        repeats=args.repeats,
    )
    import mlp  # noqa: F401

    import lightning_decentral  # noqa: F401  imported once here, inherited by the forked workers

    started = time.monotonic()
    with harness.network_or_loopback(link, args.workers) as network:
        setting = network.shaping if network is not None else "loopback TCP (gloo), no shaping"
        print(
            f"{args.workers} workers, {setting}; MLP {'-'.join(map(str, args.widths))}, batch {args.batch_size}, "
            f"topology {args.topology}; {args.warmup}+{args.steps} steps per run",
            flush=True,
        )
        records = harness.run_ranks(
            functools.partial(_work, {"config": config}), args.workers, timeout=args.timeout, network=network
        )
    medians = summarize(records, args.warmup)
    setting += (
        f"; {args.workers} workers, topology {args.topology}, MLP {'-'.join(map(str, args.widths))}, "
        f"batch {args.batch_size}"
    )
    table = render_table(medians, command, setting)
    print("\n" + table + f"\n\nwhole run: {time.monotonic() - started:.0f} s")
    if args.png:
        plot(records, args.warmup, args.shown, Path(args.png), f"{args.workers} workers, {setting}")
        print(f"wrote {args.png}")
    body = {"command": command, "setting": setting, "config": config, "medians_s": medians, "records": records}
    harness.write_outputs(args.out, body, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
