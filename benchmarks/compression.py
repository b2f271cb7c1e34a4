"""Compressed gossip: the bytes on the wire per step, and the consensus each compressor reaches against its step γ
(``docs/benchmarks.md``, "Compressed gossip").

Two measurements, one command each::

    python benchmarks/compression.py bytes     # 4 gloo processes on the loopback, the 5.26M-parameter MLP's size
    python benchmarks/compression.py sweep     # the consensus-vs-γ sweep, 8 workers in one process
    python benchmarks/compression.py accuracy  # digits, 16 simulated workers, ring: each compressor at its default γ
    python benchmarks/compression.py gamma     # the same for sign, int8 and top_k:0.01 against γ
    python benchmarks/compression.py bytes --smoke; python benchmarks/compression.py sweep --smoke   # seconds

``bytes``: every rank holds a float32 buffer of the MLP's size (5,257,226 elements) and runs ``--steps`` exchanges of
gossip alone on ``one_peer_exponential`` (one message per rank and step), plain (``Gossip``) and with each
compressor (``CompressedGossip``). Counted: the bytes each rank reports (``Gossip.bytes_sent``; ``wire_bytes``, the
messages handed to the transport). Measured: the growth of the loopback interface's received-bytes counter in
``/proc/net/dev`` over the same exchanges, read on rank 0 after a barrier that every rank passes before sending and
after one that every rank passes once done (so it includes two barriers and TCP/IP headers). Other processes on the
machine may use the loopback too: of ``--reps`` repetitions the one with the least measured bytes counts. The time
is the median of the slowest rank's per-exchange time (compressing, sending, receiving, correcting), on a machine
whose cores the ranks share.

``accuracy`` and ``gamma``: ``SimulatedDecentralizedStrategy(workers=16)`` on the digits of
``examples/reproduce/common.py`` (``DigitsMLP``: an MLP 64-128-128-10, ``SGD(lr=0.1, momentum=0.9)``, a global
batch of 512, i.e. 32 per worker, ``--epochs`` epochs of the 1,438 training digits), ring, AWC, for ``--seeds`` seeds
(each seed its own initial model and data order, the same in every row): the accuracy of ``x̄`` on the 359 held-out
digits, and the final consensus distance ``Ξ = sqrt(mean_i ‖x_i − x̄‖²)`` over ``‖x̄‖``. ``accuracy`` runs the
all-reduce equivalent (``topology="complete", combine="atc"``: every worker takes the averaged update, synchronous
momentum SGD, as DDP does), uncompressed gossip and each compressor at its default γ; ``gamma`` the compressors of
``--compressions`` (default ``sign,int8,top_k:0.01``) at each γ of ``--gammas``. ``--alpha a``: each worker's
shard skewed in its labels (``DirichletSampler``, concentration ``a``) instead of IID. Compressed runs keep the
workers apart (``vectorize="auto"`` says why); the others are stacked.

``sweep``: gossip alone (learning rate 0) from different replicas (``N(0, 1)``, 1000 elements, 8 workers,
``ring`` and ``one_peer_exponential``), 200 steps, on a compressing ``DenseMixer``: the consensus distance
``sqrt(mean_i ‖x_i − x̄‖²)`` after 200 steps over its start, for each compressor and γ.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness
import torch
import torch.distributed as dist

from lightning_decentral.compression import resolve_compression
from lightning_decentral.gossip import CompressedGossip, Gossip
from lightning_decentral.mixing import DenseMixer
from lightning_decentral.topology import resolve_topology

COMPRESSIONS = ("sign", "int8", "int4", "top_k:0.01", "top_k:0.1", "random_k:0.01")
GAMMAS = (0.01, 0.03, 0.1, 0.3, 0.6, 1.0)
TRAINED = ("sign", "int8", "int4", "top_k:0.01", "random_k:0.01")  # accuracy: at their default γ
TUNED = ("sign", "int8", "top_k:0.01")  # gamma: against TRAINING_GAMMAS
TRAINING_GAMMAS = (0.05, 0.1, 0.2, 0.4, 0.7, 1.0)
BASELINES = {"all-reduce (complete, ATC)": {"topology": "complete", "combine": "atc"}, "gossip": {"topology": "ring"}}


def loopback_bytes() -> int:
    """Bytes the loopback interface has received (on ``lo`` every byte sent is received)."""
    return harness.interface_bytes("lo")[0]


def _bytes_worker(config: dict[str, Any], rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    n = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        topology = resolve_topology(config["topology"], n)
        x = torch.randn(config["numel"], generator=torch.Generator().manual_seed(rank))
        out = {}
        for name in [None, *config["compressions"]]:
            gossip = Gossip(topology)
            mixer = gossip if name is None else CompressedGossip(gossip, resolve_compression(name))
            step, repeats = 0, []
            for repetition in range(1 + config["reps"]):  # the first warms up
                dist.barrier()
                before = loopback_bytes()
                dist.barrier()  # rank 0 has read the counter: sending may start
                counted, times = 0, []
                for _ in range(config["steps"]):
                    started = time.perf_counter()
                    sent = mixer.wire_bytes if name is not None else 0
                    mixer.start([x], step).wait()
                    counted += mixer.wire_bytes - sent if name is not None else gossip.bytes_sent([x], step)
                    times.append(time.perf_counter() - started)
                    step += 1
                dist.barrier()
                measured = loopback_bytes() - before
                total = torch.tensor([counted])
                dist.all_reduce(total)
                if repetition:
                    repeats.append({"counted": int(total), "measured": measured, "times": times})
            out[str(name)] = repeats
        return out
    finally:
        dist.destroy_process_group()


def summarize_bytes(results: list[dict[str, Any]], n: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    for name, repeats in results[0].items():
        best = min(repeats, key=lambda r: r["measured"])
        slowest = [max(ranks) for i in range(len(repeats)) for ranks in zip(*(r[name][i]["times"] for r in results))]
        rows.append(
            {
                "compression": name,
                "counted_per_rank_step": best["counted"] / n / steps,
                "measured_per_rank_step": best["measured"] / n / steps,
                "overhead": best["measured"] / best["counted"] - 1,
                "exchange_ms": 1e3 * statistics.median(slowest),
            }
        )
    plain = rows[0]["counted_per_rank_step"]
    for row in rows:
        row["fewer_than_plain"] = plain / row["counted_per_rank_step"]
    return rows


def render_bytes(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| compression | counted per rank and step | measured on `lo` | overhead | fewer bytes than plain | exchange "
        "(ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['compression'] if r['compression'] != 'None' else 'none (float32)'} | "
            f"{r['counted_per_rank_step']:,.0f} B | {r['measured_per_rank_step']:,.0f} B | {100 * r['overhead']:+.2f} "
            f"% | {r['fewer_than_plain']:.1f}× | {r['exchange_ms']:.0f} |"
        )
    return "\n".join(lines)


def consensus_after(compression: str, gamma: float, topology: str, n: int, d: int, steps: int) -> float:
    """The consensus distance after `steps` steps of gossip alone over its start (`float("inf")` past 1e6)."""
    mixer = DenseMixer(
        resolve_topology(topology, n), compression=resolve_compression(compression), consensus_step=gamma
    )
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    mean = x.mean(0)
    start = float((x - mean).square().sum(1).mean().sqrt())
    rows = list(x)
    for step in range(steps):
        for pending in [mixer.worker(i).start([row], step, check_finite=False) for i, row in enumerate(rows)]:
            pending.wait()
    ratio = float((x - mean).square().sum(1).mean().sqrt()) / start
    return ratio if math.isfinite(ratio) and ratio < 1e6 else float("inf")


def sweep(
    compressions: list[str], gammas: list[float], topologies: list[str], n: int, d: int, steps: int
) -> list[dict[str, Any]]:
    rows = []
    for topology in topologies:
        for compression in compressions:
            default = resolve_compression(compression).consensus_step
            values = sorted(set(gammas) | {default})
            ratios = {str(g): consensus_after(compression, g, topology, n, d, steps) for g in values}
            rows.append({"topology": topology, "compression": compression, "default": default, "ratio": ratios})
            print(f"{topology} {compression}: " + ", ".join(f"γ={g}: {r:.1e}" for g, r in ratios.items()), flush=True)
    return rows


def render_sweep(rows: list[dict[str, Any]], gammas: list[float]) -> str:
    lines = [
        "| topology | compression | default γ | " + " | ".join(f"γ = {g}" for g in gammas) + " | at the default γ |",
        "|---|---|---|" + "---|" * len(gammas) + "---|",
    ]
    for r in rows:
        cells = [r["ratio"][str(g)] for g in gammas]
        lines.append(
            f"| {r['topology']} | {r['compression']} | {r['default']:g} | "
            + " | ".join("diverges" if c == float("inf") else f"{c:.1e}" for c in cells)
            + f" | {r['ratio'][str(r['default'])]:.1e} |"
        )
    return "\n".join(lines)


def train_digits(
    options: dict[str, Any], seed: int, workers: int, epochs: int, alpha: float | None = None
) -> dict[str, float]:
    """One simulated run on the digits: the accuracy of `x̄` and `Ξ / ‖x̄‖` at the end, and its wall time."""
    import lightning.pytorch as pl

    from lightning_decentral import SimulatedDecentralizedStrategy

    common = harness.import_example("reproduce/common")
    harness.quiet()
    torch.set_num_threads(1)
    started = time.perf_counter()
    pl.seed_everything(seed, verbose=False)
    model = common.DigitsMLP(0.1, 0.9, batch=512 // workers, alpha=alpha, seed=seed)
    strategy = SimulatedDecentralizedStrategy(workers=workers, **options)
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
    x = torch.stack(
        [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in strategy.worker_modules()]
    ).double()
    mean = x.mean(0)
    distance = float((x - mean).square().sum(1).mean().sqrt() / mean.norm())
    return {
        "accuracy": float(trainer.callback_metrics["val_acc"]),
        "distance": distance,
        "seconds": time.perf_counter() - started,
    }


def train_cells(
    cells: dict[str, dict[str, Any]], seeds: int, workers: int, epochs: int, alpha: float | None
) -> list[dict[str, Any]]:
    """Every cell (label: strategy options) over `seeds` seeds."""
    rows = []
    for label, options in cells.items():
        runs = [train_digits(options, seed, workers, epochs, alpha) for seed in range(seeds)]
        row = {
            "label": label,
            "options": options,
            **{key: [r[key] for r in runs] for key in ("accuracy", "distance", "seconds")},
        }
        rows.append(row)
        print(
            f"{label}: accuracy {_mean_std(row['accuracy'])}, Ξ/‖x̄‖ {statistics.mean(row['distance']):.2e} "
            f"({statistics.mean(row['seconds']):.1f} s a run)",
            flush=True,
        )
    return rows


def _mean_std(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * std:.{digits}f}"


def render_accuracy(rows: list[dict[str, Any]], seeds: int) -> str:
    gossip = statistics.mean(next(r for r in rows if r["label"] == "gossip")["accuracy"])
    lines = [
        f"| run | γ | accuracy of x̄ (%, {seeds} seeds) | against uncompressed gossip (points) | Ξ / ‖x̄‖ at the end |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        gamma = r["options"].get("consensus_step")
        if gamma is None and "compression" in r["options"]:
            gamma = resolve_compression(r["options"]["compression"]).consensus_step
        lines.append(
            f"| {r['label']} | {'' if gamma is None else f'{gamma:g}'} | {_mean_std(r['accuracy'])} "
            f"| {100 * (statistics.mean(r['accuracy']) - gossip):+.1f} | {statistics.mean(r['distance']):.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("bytes", "sweep", "accuracy", "gamma"))
    parser.add_argument("--compressions", default=None, help="names, comma-separated (default: each command's own)")
    parser.add_argument(
        "--gammas", default=",".join(map(str, TRAINING_GAMMAS)), help="gamma: the steps γ, comma-separated"
    )
    parser.add_argument("--seeds", type=int, default=5, help="accuracy, gamma: seeds per row (mean ± std)")
    parser.add_argument("--epochs", type=int, default=30, help="accuracy, gamma: epochs of the digits")
    parser.add_argument(
        "--alpha", type=float, default=None, help="accuracy, gamma: Dirichlet label skew per worker (default: IID)"
    )
    parser.add_argument("--workers", type=int, default=None, help="bytes: 4 processes; sweep: 8 workers")
    parser.add_argument(
        "--topology", default="one_peer_exponential", help="bytes: the topology (default one_peer_exponential)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="bytes: exchanges per repetition (3); sweep: steps (200)"
    )
    parser.add_argument("--reps", type=int, default=3, help="bytes: measured repetitions (the least measured counts)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="small sizes, few steps")
    args = parser.parse_args(argv)
    default = {"bytes": COMPRESSIONS, "sweep": COMPRESSIONS, "accuracy": TRAINED, "gamma": TUNED}[args.what]
    compressions = args.compressions.split(",") if args.compressions else list(default)
    for name in compressions:
        resolve_compression(name)  # a bad name fails here, naming the choices
    started = time.monotonic()
    harness.exit_on_sigterm()
    if args.what == "bytes":
        n = args.workers or 4
        config = {
            "numel": 100_000 if args.smoke else harness.count_parameters(harness.FULL_WIDTHS),
            "steps": args.steps or (1 if args.smoke else 3),
            "reps": 1 if args.smoke else args.reps,
            "compressions": compressions,
            "topology": args.topology,
        }
        print(
            f"{n} gloo processes on the loopback, {args.topology}, {config['numel']:,} float32 elements, "
            f"{config['steps']} exchanges x {config['reps']} repetitions; {os.cpu_count()} CPU cores; torch "
            f"{torch.__version__}"
        )
        results = harness.run_ranks(functools.partial(_bytes_worker, config), n, timeout=args.timeout)
        rows = summarize_bytes(results, n, config["steps"])
        table = render_bytes(rows)
    elif args.what in ("accuracy", "gamma"):
        n = args.workers or (4 if args.smoke else 16)
        seeds, epochs = (1, 1) if args.smoke else (args.seeds, args.epochs)
        data = "IID" if args.alpha is None else f"label skew Dirichlet α = {args.alpha:g}"
        print(
            f"digits ({data}), {n} simulated workers, ring, AWC, {epochs} epochs, {seeds} seeds; torch "
            f"{torch.__version__}",
            flush=True,
        )
        if args.what == "accuracy":
            cells = {**BASELINES, **{name: {"topology": "ring", "compression": name} for name in compressions}}
        else:
            gammas = [float(g) for g in args.gammas.split(",")][: 2 if args.smoke else None]
            cells = {
                f"{name}, γ = {g:g}": {"topology": "ring", "compression": name, "consensus_step": g}
                for name in compressions
                for g in gammas
            }
            cells = {"gossip": BASELINES["gossip"], **cells}
        rows = train_cells(cells, seeds, n, epochs, args.alpha)
        table = render_accuracy(rows, seeds)
    else:
        n, d, steps = args.workers or 8, 100 if args.smoke else 1000, args.steps or (10 if args.smoke else 200)
        gammas = [0.3, 1.0] if args.smoke else list(GAMMAS)
        print(f"gossip alone, {n} workers, {d} elements, {steps} steps, N(0, 1) replicas; torch {torch.__version__}")
        rows = sweep(compressions, gammas, ["ring", "one_peer_exponential"], n, d, steps)
        table = render_sweep(rows, gammas)
    print(table)
    print(f"\nwhole run: {time.monotonic() - started:.0f} s")
    body = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": rows}
    harness.write_outputs(args.out, body, table, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
