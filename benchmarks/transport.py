"""Time one neighbour exchange on a ring, per transport and message size (``docs/benchmarks.md``, transport).

One command regenerates the table::

    python benchmarks/transport.py                    # 4 gloo processes, 4 KB .. 64 MB, every transport
    python benchmarks/transport.py --smoke            # 2 small sizes, 2 repetitions (seconds)
    python benchmarks/transport.py --sizes 4096,1048576 --reps 20 --out transport.md --out transport.json

Every rank holds a float32 vector ``x_i`` and computes the ring average
``sum_j w_ij x_j`` (``w = 1/3`` for itself and its two neighbours), the operation the gossip
engine runs for ``topology="ring"``. The transports:

* ``p2p``: :class:`~lightning_decentral.gossip.Gossip` with ``transport="p2p"``: ``batch_isend_irecv``.
* ``edge_broadcast``: ``Gossip`` with ``transport="broadcast"``: one 2-rank subgroup per edge,
  each endpoint broadcasts ``x`` to the other.
* ``edge_allreduce``: one 2-rank subgroup per edge; each rank all-reduces ``w x_i`` on each of its
  edges' groups (Decent-DP's approach); the sum over an edge is ``w (x_i + x_j)``.
* ``allgather``: one all-gather of every ``x_j`` over the world, then the neighbours' are combined.
* ``allreduce``: one world all-reduce of ``x`` (the exact average, ``topology="complete"``; what
  DDP pays per step for its gradients): a reference point, not a neighbour exchange.

Timing: every repetition starts after a barrier; the slowest rank's wall time of the exchange
(post, wait, combine) counts; the table shows the median over repetitions (``--reps``, after
``--warmup``). Every transport's result is checked against ``p2p``'s before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
import torch.distributed as dist

from lightning_decentral.gossip import Gossip
from lightning_decentral.topology import Ring

SIZES = (4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20, 64 * 2**20)
SMOKE_SIZES = (4 * 2**10, 64 * 2**10)
TRANSPORTS = ("p2p", "edge_broadcast", "edge_allreduce", "allgather", "allreduce")


class Ringside:
    """The ring's edges as 2-rank subgroups, created in the same order on every rank."""

    def __init__(self, n: int, rank: int) -> None:
        self.n, self.rank = n, rank
        self.edges = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1)]
        groups = [dist.new_group(sorted(edge)) for edge in self.edges]  # collective: every rank, every group
        self.mine = [(edge, group) for edge, group in zip(self.edges, groups) if rank in edge]
        self.weight = 1.0 / 3 if n > 2 else 0.5

    def edge_allreduce(self, x: torch.Tensor, scratch: list[torch.Tensor]) -> torch.Tensor:
        works = []
        for (_edge, group), buffer in zip(self.mine, scratch):
            torch.mul(x, self.weight, out=buffer)
            works.append(dist.all_reduce(buffer, group=group, async_op=True))
        for work in works:
            work.wait()
        out = x * (1 - 2 * len(self.mine) * self.weight)  # w_ii x_i, less the w x_i each edge sum holds
        for buffer in scratch:
            out.add_(buffer)
        return out


def _exchange(
    name: str, rank: int, n: int, x: torch.Tensor, ring: Ringside, engines: dict[str, Gossip]
) -> Callable[[], torch.Tensor]:
    """A function doing one exchange of ``x`` with ``name``, returning ``sum_j w_ij x_j``."""
    scratch = [torch.empty_like(x) for _ in ring.mine]
    if name in engines:
        buffer = torch.empty_like(x)

        def engine() -> torch.Tensor:
            buffer.copy_(x)  # the engine mixes in place; the copy keeps x for the next repetition
            engines[name].start([buffer], 0).wait()
            return buffer

        return engine
    if name == "edge_allreduce":
        return lambda: ring.edge_allreduce(x, scratch)
    if name == "allgather":
        gathered = [torch.empty_like(x) for _ in range(n)]
        neighbours = sorted({(rank - 1) % n, (rank + 1) % n} - {rank})

        def allgather() -> torch.Tensor:
            dist.all_gather(gathered, x)
            out = x * (1 - len(neighbours) * ring.weight)
            for j in neighbours:
                out.add_(gathered[j], alpha=ring.weight)
            return out

        return allgather
    if name == "allreduce":
        buffer = torch.empty_like(x)

        def allreduce() -> torch.Tensor:
            buffer.copy_(x)
            dist.all_reduce(buffer)
            return buffer.div_(n)

        return allreduce
    raise ValueError(name)


def _worker(config: dict[str, Any], rank: int) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    n = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        return _measure(rank, n, config)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, n: int, config: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    ring = Ringside(n, rank)
    engines = {
        name: Gossip(Ring(world_size=n), transport=transport)
        for name, transport in (("p2p", "p2p"), ("edge_broadcast", "broadcast"))
    }
    times: dict[str, dict[str, list[float]]] = {}
    for size in config["sizes"]:
        x = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        expected = _exchange("p2p", rank, n, x, ring, engines)().clone()
        times[str(size)] = {}
        for name in config["transports"]:
            exchange = _exchange(name, rank, n, x, ring, engines)
            if name != "allreduce":
                torch.testing.assert_close(exchange(), expected, atol=1e-5, rtol=1e-5)
            samples = []
            for repetition in range(config["warmup"] + config["reps"]):
                dist.barrier()
                start = time.perf_counter()
                exchange()
                if repetition >= config["warmup"]:
                    samples.append(time.perf_counter() - start)
            times[str(size)][name] = samples
    return times


def summarize(results: list[dict[str, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """One row per size: the median over repetitions of the slowest rank's time, per transport."""
    rows = []
    for size in results[0]:
        row: dict[str, Any] = {"bytes": int(size), "median_s": {}}
        for name in results[0][size]:
            slowest = [max(column) for column in zip(*(r[size][name] for r in results))]
            row["median_s"][name] = statistics.median(slowest)
        neighbour = {k: v for k, v in row["median_s"].items() if k != "allreduce"}
        row["fastest"] = min(neighbour, key=neighbour.get)
        rows.append(row)
    return rows


def _fmt_size(size: int) -> str:
    return f"{size // 2**20} MB" if size >= 2**20 else f"{size // 2**10} KB"


def render(rows: list[dict[str, Any]]) -> str:
    names = list(rows[0]["median_s"])
    lines = [
        "| message | "
        + " | ".join(f"{name} (ms)" for name in names)
        + " | fastest neighbour exchange | its ratio to p2p |",
        "|---|" + "---|" * len(names) + "---|---|",
    ]
    for row in rows:
        times = row["median_s"]
        best = row["fastest"]
        lines.append(
            f"| {_fmt_size(row['bytes'])} | "
            + " | ".join(f"{1e3 * times[name]:.2f}" for name in names)
            + f" | {best} | {times[best] / times['p2p']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--sizes", default=None, help="message sizes in bytes, comma-separated (default 4 KB .. 64 MB)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help=f"from {','.join(TRANSPORTS)}")
    parser.add_argument(
        "--reps", type=int, default=None, help="measured repetitions per size and transport (default 15)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="repetitions dropped first (default 3)")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="2 small sizes, 2 repetitions")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(SMOKE_SIZES if args.smoke else SIZES)
    transports = args.transports.split(",")
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown or "p2p" not in transports:
        parser.error(f"--transports takes names from {','.join(TRANSPORTS)} and must include p2p (unknown: {unknown})")
    if args.workers < 2 or any(s < 4 or s % 4 for s in sizes):
        parser.error("--workers must be >= 2 and every size a positive multiple of 4 bytes")
    config = {
        "sizes": sizes,
        "transports": transports,
        "reps": args.reps or (2 if args.smoke else 15),
        "warmup": args.warmup if args.warmup is not None else (1 if args.smoke else 3),
    }
    print(
        f"{args.workers} gloo processes, ring exchange, float32; {config['warmup']} warm-up + {config['reps']} "
        f"measured repetitions; {os.cpu_count()} CPU cores; torch {torch.__version__}",
        flush=True,
    )
    started = time.monotonic()
    harness.exit_on_sigterm()
    results = harness.run_ranks(functools.partial(_worker, config), args.workers, timeout=args.timeout)
    rows = summarize(results)
    table = render(rows)
    print(table)
    print(f"\nwhole run: {time.monotonic() - started:.0f} s")
    body = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workers": args.workers,
        "config": config,
        "rows": rows,
    }
    harness.write_outputs(args.out, body, table, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
