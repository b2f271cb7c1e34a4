"""Issue 30's headline: the byte-level language model of ``outer.py`` trained by 8 workers, each on its own
emulated host (``netns.py``'s network), for DDP, D-PSGD, DiLoCo and gossip with an outer optimizer: validation
loss against wall-clock time and against bytes sent. Root on Linux.

    python benchmarks/outer_network.py                          # profiles 1gbit and 100mbit, H = 50
    python benchmarks/outer_network.py --smoke                  # 2 hosts, a few steps, H = 2
    python benchmarks/outer_network.py --profiles 100mbit --methods ddp,diloco --out t.md --out t.json

The model, its data and the inner optimizer are ``outer.py``'s (``ByteGPT``, the standard library's own source as
bytes, AdamW); each worker reads its shard of the training windows (Lightning's distributed sampler). The network,
the forked workers joining with ``Trainer(num_nodes=n, devices=1)``, one process group per profile: ``harness``
(see ``netns.py``). The methods (``methods``): ``ddp`` (Lightning's, gradients all-reduced every step);
``dpsgd_one_peer`` (AWC on ``one_peer_exponential`` every step); ``diloco`` (``topology="complete"``,
``gossip_every=H``, DiLoCo's outer Nesterov step); ``outer_one_peer`` (the same outer step over one-peer gossip);
``outer_one_peer_sign`` and ``diloco_sign`` (the same with ``compression="sign"``; a method the strategy refuses
is skipped, with its reason); ``dpsgd_ring``, ``outer_ring`` and ``outer_ring_sign`` (the same on a ring, a graph
whose edges are the same at every round).

``ddp`` trains ``--steps`` (500) optimizer steps, where every method's loss is compared (the same tokens); the
others go on to ``--extend`` (2) times that, to see when they reach ddp's final loss.

Measured per worker, every ``H`` steps (where every method's model is defined: right after an outer step), at
step ``--steps`` and at the last: the validation loss of the worker's own model (mean cross-entropy, nats per byte, over
the first ``--val-windows`` held-out windows), the training time since a common start (a barrier) with the
evaluations' own time taken out, the bytes the strategy counts (``strategy.observe``; DDP, which counts nothing,
gets the ring all-reduce's ``2 (n − 1)/n`` of its gradients per step), and the bytes its host's ``eth0`` sent and
received (``/proc/net/dev``, headers and gloo's own traffic included). Nothing extra is communicated while timed.
A point of the curve: the loss averaged over the workers, the slowest worker's time, the bytes per worker.
Every ratio is against ``ddp`` in the same run (same processes, same network, same load).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

import harness
import lightning.pytorch as pl
import outer
import torch

GOALS = (
    "time to DDP's final loss <= 0.2x DDP's (100 Mbit/s); bytes/step <= 1/H of the same topology every step; "
    "loss at the same tokens within 2 % of DDP's, gossip + outer within 1 % of DiLoCo's"
)


def methods(every: int) -> dict[str, dict[str, Any] | None]:
    """Name -> ``DecentralizedStrategy`` options (``None``: Lightning's DDP). One entry per method; a variant
    is one more entry."""
    simulated = outer.methods(every)  # the options of outer.py's simulation, run here on processes
    return {
        "ddp": None,
        "dpsgd_one_peer": simulated["dpsgd_one_peer"],
        "diloco": simulated["diloco"],
        "outer_one_peer": simulated["outer_one_peer"],
        "outer_one_peer_sign": simulated["outer_one_peer_sign"],
        "diloco_sign": simulated["diloco_sign"],
        "dpsgd_ring": {"topology": "ring"},
        "outer_ring": {**simulated["outer_one_peer"], "topology": "ring"},
        "outer_ring_sign": {**simulated["outer_one_peer_sign"], "topology": "ring"},
    }


# what each method is compared with for the bytes goal: the same topology exchanging at every step
SAME_TOPOLOGY_EVERY_STEP = {
    "diloco": "ddp",
    "outer_one_peer": "dpsgd_one_peer",
    "outer_one_peer_sign": "dpsgd_one_peer",
    "diloco_sign": "ddp",
    "outer_ring": "dpsgd_ring",
    "outer_ring_sign": "dpsgd_ring",
}


def make_strategy(options: dict[str, Any] | None) -> Any:
    """The strategy of a method (raises the strategy's ``ValueError`` where it refuses the options)."""
    from lightning_decentral import DecentralizedStrategy

    return "ddp" if options is None else DecentralizedStrategy(**options)


def refusals(chosen: dict[str, dict[str, Any] | None]) -> dict[str, str]:
    """The methods the strategy refuses at construction, with its reason."""
    refused = {}
    for name, options in chosen.items():
        try:
            make_strategy(options)
        except ValueError as error:
            refused[name] = str(error)
    return refused


# -- inside a worker -------------------------------------------------------------------------------------


class Curve(pl.Callback):
    """Every ``every`` steps, at step ``also`` and at the last: the worker's validation loss, training time and bytes so
    far."""

    def __init__(self, val: Any, every: int, also: int, counted: Any, ddp_bytes_per_step: float | None) -> None:
        self.val, self.every, self.also, self.counted, self.ddp_bytes_per_step = (
            val,
            every,
            also,
            counted,
            ddp_bytes_per_step,
        )
        self.points: list[dict[str, Any]] = []
        self.start, self.paused, self.sent0, self.received0 = 0.0, 0.0, 0, 0
        self.load: list[float] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        trainer.strategy.barrier()  # a common start
        self.load.append(os.getloadavg()[0])
        self.received0, self.sent0 = harness.interface_bytes(harness.EmulatedNetwork.interface)
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every and step not in (self.also, trainer.max_steps):
            return
        now = time.monotonic()
        received, sent = harness.interface_bytes(harness.EmulatedNetwork.interface)
        counted = self.counted.sent if self.ddp_bytes_per_step is None else self.ddp_bytes_per_step * step
        module.eval()
        with torch.no_grad():
            loss = float(module.loss((self.val,)))
        module.train()
        self.points.append(
            {
                "step": step,
                "seconds": now - self.start - self.paused,
                "loss": loss,
                "counted": counted,
                "eth0_sent": sent - self.sent0,
                "eth0_received": received - self.received0,
            }
        )
        self.paused += time.monotonic() - now

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.load.append(os.getloadavg()[0])


def _job(method: str, config: dict[str, Any], data: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    from mlp import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    options = methods(config["every"])[method]
    strategy = make_strategy(options)
    pl.seed_everything(0, verbose=False)  # the same start on every worker and for every method
    model = outer.ByteGPT(config["context"], config["width"], config["layers"])
    counted = outer.Bytes()
    ddp_bytes = None
    if options is None:
        ddp_bytes = 2 * (world_size - 1) / world_size * sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        strategy.observe(counted)
    curve = Curve(data["val"], config["every"], config["steps"], counted, ddp_bytes)
    steps = config["steps"] if options is None else round(config["extend"] * config["steps"])
    trainer = quiet_trainer(
        strategy, steps, [curve], num_nodes=world_size, devices=1, num_sanity_val_steps=0, limit_val_batches=0
    )
    loader = DataLoader(TensorDataset(data["train"]), batch_size=config["batch"], shuffle=True, drop_last=True)
    trainer.fit(model, loader)
    return {"points": curve.points, "load": curve.load}


def work(spec: dict[str, Any], data: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """One worker: every method of ``spec`` in order, in one process group; per method, its curve points."""
    harness.use_threads(spec["config"]["threads"])
    harness.quiet()
    world_size = int(os.environ["WORLD_SIZE"])
    return [{"method": m, **_job(m, spec["config"], data, rank, world_size)} for m in spec["methods"]]


# -- the driver ------------------------------------------------------------------------------------------


def combine(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve: per point, the loss averaged over the workers, the slowest one's time, bytes per worker."""
    n = len(per_rank)
    points = []
    for column in zip(*(r["points"] for r in per_rank)):
        points.append(
            {
                "step": column[0]["step"],
                "seconds": max(p["seconds"] for p in column),
                "loss": statistics.fmean(p["loss"] for p in column),
                "loss_spread": max(p["loss"] for p in column) - min(p["loss"] for p in column),
                **{key: sum(p[key] for p in column) / n for key in ("eth0_sent", "eth0_received")},
                "counted": None if None in (p["counted"] for p in column) else sum(p["counted"] for p in column) / n,
            }
        )
    return points


def summarize(
    curves: dict[str, list[dict[str, Any]]], steps: int, same_topology: dict[str, str] = SAME_TOPOLOGY_EVERY_STEP
) -> list[dict[str, Any]]:
    """One row per method: its loss, time and bytes at step ``steps`` (the same tokens for every method; counted:
    ``None`` where nothing counts them), when it first reached ddp's loss at that step (over its whole curve), and
    the goals' ratios: against ``ddp``, against ``diloco``, bytes against ``same_topology[method]``'s."""
    ddp = next(p for p in curves["ddp"] if p["step"] == steps)
    rows = []
    for name, curve in curves.items():
        last = next(p for p in curve if p["step"] == steps)
        reached = next((p for p in curve if p["loss"] <= ddp["loss"]), None)
        ddp_there = next((p for p in curves["ddp"] if p["loss"] <= last["loss"]), None)
        rows.append(
            {
                "method": name,
                "loss": last["loss"],
                "seconds": last["seconds"],
                "loss_vs_ddp": last["loss"] / ddp["loss"] - 1,
                "time_ratio": last["seconds"] / ddp["seconds"],
                "steps_run": curve[-1]["step"],
                "to_ddp_loss_step": reached["step"] if reached else None,
                "to_ddp_loss_s": reached["seconds"] if reached else None,
                "to_ddp_loss_ratio": reached["seconds"] / ddp["seconds"] if reached else None,
                "ddp_to_this_loss_s": ddp_there["seconds"] if ddp_there else None,
                "counted_per_step": None if last["counted"] is None else last["counted"] / steps,
                "eth0_sent_per_step": last["eth0_sent"] / steps,
            }
        )
    by = {r["method"]: r for r in rows}
    for row in rows:
        base = by.get(same_topology.get(row["method"], ""))
        counted = base and row["counted_per_step"] is not None
        row["bytes_vs_every_step"] = row["counted_per_step"] / base["counted_per_step"] if counted else None
        row["eth0_vs_every_step"] = row["eth0_sent_per_step"] / base["eth0_sent_per_step"] if base else None
        if "diloco" in by and row["method"] not in ("ddp", "dpsgd_one_peer", "diloco"):
            row["loss_vs_diloco"] = row["loss"] / by["diloco"]["loss"] - 1
    return rows


def render(profile: dict[str, Any], every: int, command: str) -> str:
    """One profile in Markdown: the methods' table, the skipped methods' reasons, the curves by step."""
    rows, curves = profile["rows"], profile["curves"]

    def optional(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"**{profile['link']['name']}**: {profile['shaping']}; TCP goodput host 0 → host 1: "
        f"{profile['goodput_gbit']:.3f} Gbit/s; load average {profile['load'][0]:.1f} before, "
        f"{profile['load'][1]:.1f} after. Command: `{command}`",
        "",
        "| method | val loss at the same tokens | vs ddp | time (s) | / ddp | time to ddp's final loss (s, step) | / "
        "ddp's time | ddp's time to this loss (s) | counted B/step/worker | eth0 sent B/step/host | vs same topology "
        "every step (counted, eth0) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = r.get("loss_vs_diloco")
        lines.append(
            f"| {r['method']} | {r['loss']:.4f} | {100 * r['loss_vs_ddp']:+.2f} %"
            + (f" ({100 * vs:+.2f} % vs diloco)" if vs is not None else "")
            + f" | {r['seconds']:.1f} | {r['time_ratio']:.2f} | {optional(r['to_ddp_loss_s'], '.1f')}"
            + (f" (step {r['to_ddp_loss_step']})" if r["to_ddp_loss_step"] else f" (not in {r['steps_run']} steps)")
            + " | "
            f"{optional(r['to_ddp_loss_ratio'], '.2f')} | {optional(r['ddp_to_this_loss_s'], '.1f')} | "
            f"{optional(r['counted_per_step'], ',.0f')} | {r['eth0_sent_per_step']:,.0f} | "
            + (
                f"{optional(r['bytes_vs_every_step'], '.4f')}, {r['eth0_vs_every_step']:.4f} (1/H = {1 / every:.4f})"
                if r["eth0_vs_every_step"] is not None
                else "—"
            )
            + " |"
        )
    lines += [f"| {name} | skipped: the strategy refuses it (below) | | | | | | | | | |" for name in profile["skipped"]]
    lines += [f"\nSkipped `{name}`: {why}" for name, why in profile["skipped"].items()]
    lines += [
        "",
        "The curves: validation loss averaged over the workers @ the slowest worker's training time, MB sent "
        "per worker (counted / eth0):",
        "",
        "| step | " + " | ".join(curves) + " |",
        "|---|" + "---|" * len(curves),
    ]
    at = {name: {p["step"]: p for p in curve} for name, curve in curves.items()}
    for step in sorted({step for points in at.values() for step in points}):
        cells = [at[name].get(step) for name in curves]
        lines.append(
            f"| {step} | "
            + " | ".join(
                ""
                if p is None
                else (
                    f"{p['loss']:.3f} @ {p['seconds']:.0f} s, {optional(p['counted'] and p['counted'] / 1e6, '.1f')}/"
                    f"{p['eth0_sent'] / 1e6:.1f} MB"
                )
                for p in cells
            )
            + " |"
        )
    return "\n".join(lines)


def plot(profiles: list[dict[str, Any]], path: str) -> None:
    """Validation loss against time and against eth0 bytes sent per host, one row per profile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(profiles), 2, figsize=(9, 3.4 * len(profiles)), squeeze=False)
    for (left, right), profile in zip(axes, profiles):
        for name, curve in profile["curves"].items():
            left.plot([p["seconds"] for p in curve], [p["loss"] for p in curve], marker="o", markersize=3, label=name)
            right.plot(
                [p["eth0_sent"] / 1e6 for p in curve], [p["loss"] for p in curve], marker="o", markersize=3, label=name
            )
        left.set_xlabel("training time (s)")
        right.set_xlabel("MB sent per host (eth0)")
        right.set_xscale("log")
        for ax in (left, right):
            ax.set_ylabel("validation loss (nats/byte)")
            ax.set_title(profile["link"]["name"], fontsize=9)
            ax.grid(True, alpha=0.3)
    axes[0][1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--profiles", default="1gbit,100mbit", help=f"comma-separated, from {','.join(harness.PROFILES)}"
    )
    parser.add_argument("--methods", default="", help="comma-separated (default: all of `methods`); ddp is always run")
    parser.add_argument("--workers", type=int, default=8, help="hosts, one worker each")
    parser.add_argument("--steps", type=int, default=500, help="ddp's optimizer steps (where the losses are compared)")
    parser.add_argument(
        "--extend",
        type=float,
        default=2.0,
        help="the other methods train this many times --steps, to see when they reach ddp's final loss",
    )
    parser.add_argument("--every", type=int, default=50, help="H, the inner steps of a round (and the curve's spacing)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker and step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=3_000_000, help="how much of the standard library to read")
    parser.add_argument("--val-windows", type=int, default=256, help="held-out windows each evaluation reads")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per profile")
    parser.add_argument("--png", default="", help="the curves as a figure")
    parser.add_argument("--out", action="append", default=[], help="write results: .md (tables) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="1gbit, 2 hosts, 4 steps, H = 2, a tiny model")
    args = parser.parse_args(argv)
    if args.smoke:
        args.profiles = "1gbit" if args.profiles == parser.get_default("profiles") else args.profiles
        args.workers, args.steps, args.every, args.batch, args.width = 2, 4, 2, 4, 16
        args.bytes, args.val_windows = 200_000, 16
    args.profiles = args.profiles.split(",")
    every_method = list(methods(args.every))
    args.methods = ["ddp"] + [m for m in args.methods.split(",") if m and m != "ddp"] if args.methods else every_method
    unknown = [p for p in args.profiles if p not in harness.PROFILES] + [
        m for m in args.methods if m not in every_method
    ]
    if unknown:
        parser.error(f"unknown {unknown}; profiles: {list(harness.PROFILES)}, methods: {every_method}")
    if args.steps < args.every or args.workers < 2:
        parser.error("--steps must be at least --every (one round), and --workers at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ok, why = harness.netns_permitted()
    if not ok:
        print(f"outer_network.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    harness.exit_on_sigterm()
    chosen = {m: methods(args.every)[m] for m in args.methods}
    skipped = refusals(chosen)
    for name, reason in skipped.items():
        print(f"skipped {name}: the strategy refuses it: {reason}", flush=True)
    run = [m for m in chosen if m not in skipped]
    windows = outer.sequences(outer.stdlib_bytes(args.bytes), args.context)
    split = int(0.9 * len(windows))
    data = {"train": windows[:split], "val": windows[split:][: args.val_windows]}
    config = {
        k: getattr(args, k) for k in ("steps", "extend", "every", "batch", "context", "width", "layers", "threads")
    }
    command = harness.command_line(__file__, argv)
    parameters = sum(p.numel() for p in outer.ByteGPT(args.context, args.width, args.layers).parameters())
    tokens = args.steps * args.workers * args.batch * args.context
    print(
        f"{args.workers} hosts; ByteGPT width {args.width}, {args.layers} layers, context {args.context} "
        f"({parameters:,} parameters); {args.steps} steps of {args.batch} sequences per worker ({tokens:,} tokens); "
        f"H = {args.every}; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, Any] = {"profiles": []}
    tables = []
    started = time.monotonic()
    for name in args.profiles:
        link = harness.PROFILES[name]
        load_before = os.getloadavg()[0]
        with harness.EmulatedNetwork(args.workers, link) as network:
            goodput = network.throughput_gbit(0.5 if args.smoke else 1.0)
            print(f"[{name}] {network.shaping}; TCP goodput {goodput:.3f} Gbit/s", flush=True)
            spec = {"config": config, "methods": run}
            t0 = time.monotonic()
            records = harness.run_ranks(
                functools.partial(work, spec, data), args.workers, timeout=args.timeout, network=network
            )
            namespaces = [*network.namespaces, network.hub]
        curves = {m: combine([r[i] for r in records]) for i, m in enumerate(run)}
        profile = {
            "link": asdict(link),
            "shaping": network.shaping,
            "delay_applied": network.delay_applied,
            "goodput_gbit": goodput,
            "wall_s": time.monotonic() - t0,
            "load": [load_before, os.getloadavg()[0]],
            "skipped": skipped,
            "curves": curves,
            "job_load": {m: records[0][i]["load"] for i, m in enumerate(run)},
            "namespaces": namespaces,
            "rows": summarize(curves, args.steps),
        }
        results["profiles"].append(profile)
        tables.append(render(profile, args.every, command))
        print("\n" + tables[-1] + "\n", flush=True)
    results["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": config,
        "workers": args.workers,
        "parameters": parameters,
        "tokens": tokens,
        "val_windows": args.val_windows,
        "train_windows": split,
        "cpu_cores": os.cpu_count(),
        "elapsed_s": time.monotonic() - started,
        "goals": GOALS,
    }
    print(f"whole run: {results['meta']['elapsed_s']:.0f} s")
    if args.png:
        plot(results["profiles"], args.png)
    harness.write_outputs(args.out, results, "\n\n".join(tables), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
