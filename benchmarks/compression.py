"""Compressed gossip: the bytes on the wire per step, and the consensus each compressor reaches against its step γ
(``docs/benchmarks.md``, "Compressed gossip").

Two measurements, one command each::

    python benchmarks/compression.py bytes     # 4 gloo processes on the loopback, the 5.26M-parameter MLP's size
    python benchmarks/compression.py sweep     # the consensus-vs-γ sweep, 8 workers in one process
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
from typing import Any, Optional

import torch
import torch.distributed as dist

import harness
from lightning_decentral.compression import resolve_compression
from lightning_decentral.gossip import CompressedGossip, Gossip
from lightning_decentral.mixing import DenseMixer
from lightning_decentral.topology import resolve_topology

COMPRESSIONS = ("sign", "int8", "int4", "top_k:0.01", "top_k:0.1", "random_k:0.01")
GAMMAS = (0.01, 0.03, 0.1, 0.3, 0.6, 1.0)


def loopback_bytes() -> int:
    """Bytes the loopback interface has received (on ``lo`` every byte sent is received)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[0])
    raise RuntimeError("no loopback interface in /proc/net/dev")


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
        rows.append({
            "compression": name,
            "counted_per_rank_step": best["counted"] / n / steps,
            "measured_per_rank_step": best["measured"] / n / steps,
            "overhead": best["measured"] / best["counted"] - 1,
            "exchange_ms": 1e3 * statistics.median(slowest),
        })
    plain = rows[0]["counted_per_rank_step"]
    for row in rows:
        row["fewer_than_plain"] = plain / row["counted_per_rank_step"]
    return rows


def render_bytes(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| compression | counted per rank and step | measured on `lo` | overhead | fewer bytes than plain | exchange (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['compression'] if r['compression'] != 'None' else 'none (float32)'} | {r['counted_per_rank_step']:,.0f} B "
            f"| {r['measured_per_rank_step']:,.0f} B | {100 * r['overhead']:+.2f} % | {r['fewer_than_plain']:.1f}× "
            f"| {r['exchange_ms']:.0f} |"
        )
    return "\n".join(lines)


def consensus_after(compression: str, gamma: float, topology: str, n: int, d: int, steps: int) -> float:
    """The consensus distance after `steps` steps of gossip alone over its start (`float("inf")` past 1e6)."""
    mixer = DenseMixer(resolve_topology(topology, n), compression=resolve_compression(compression), consensus_step=gamma)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    mean = x.mean(0)
    start = float((x - mean).square().sum(1).mean().sqrt())
    rows = list(x)
    for step in range(steps):
        for pending in [mixer.worker(i).start([row], step, check_finite=False) for i, row in enumerate(rows)]:
            pending.wait()
    ratio = float((x - mean).square().sum(1).mean().sqrt()) / start
    return ratio if math.isfinite(ratio) and ratio < 1e6 else float("inf")


def sweep(compressions: list[str], gammas: list[float], topologies: list[str], n: int, d: int, steps: int) -> list[dict[str, Any]]:
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("bytes", "sweep"))
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS), help="names, comma-separated")
    parser.add_argument("--workers", type=int, default=None, help="bytes: 4 processes; sweep: 8 workers")
    parser.add_argument("--topology", default="one_peer_exponential", help="bytes: the topology (default one_peer_exponential)")
    parser.add_argument("--steps", type=int, default=None, help="bytes: exchanges per repetition (3); sweep: steps (200)")
    parser.add_argument("--reps", type=int, default=3, help="bytes: measured repetitions (the least measured counts)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="small sizes, few steps")
    args = parser.parse_args(argv)
    compressions = args.compressions.split(",")
    for name in compressions:
        resolve_compression(name)  # a bad name fails here, naming the choices
    started = time.monotonic()
    harness.exit_on_sigterm()
    if args.what == "bytes":
        n = args.workers or 4
        config = {
            "numel": 100_000 if args.smoke else harness.count_parameters(harness.FULL_WIDTHS),
            "steps": args.steps or (1 if args.smoke else 3), "reps": 1 if args.smoke else args.reps,
            "compressions": compressions, "topology": args.topology,
        }
        print(f"{n} gloo processes on the loopback, {args.topology}, {config['numel']:,} float32 elements, "
              f"{config['steps']} exchanges x {config['reps']} repetitions; {os.cpu_count()} CPU cores; torch {torch.__version__}")
        results = harness.run_ranks(functools.partial(_bytes_worker, config), n, timeout=args.timeout)
        rows = summarize_bytes(results, n, config["steps"])
        table = render_bytes(rows)
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
