"""Alpha-beta cost model: measured on this machine, extrapolated to 8-1024 GPUs.

One command regenerates the tables in ``docs/benchmarks.md`` and ``docs/img/benchmarks/cost_model.png``
(as root for the emulated link)::

    python benchmarks/cost_model.py
    python benchmarks/cost_model.py --networks loopback            # no namespaces needed
    python benchmarks/cost_model.py --smoke                         # tiny sizes, loopback, no figure unless --png

**Measured.** On each network of ``--networks`` (``loopback``: 127.0.0.1 TCP; a profile of
``benchmarks/netns.py`` such as ``1gbit``: hosts in namespaces behind a shaped switch),
``--workers`` gloo processes start; ranks 0 and 1 ping-pong messages of 4 B to 16 MB
(``dist.send`` / ``dist.recv``), and the one-way time ``t(m) = RTT / 2`` is fitted by
``t(m) = alpha + beta m``: ``beta`` the slope over messages of 1 MiB and more, ``alpha`` what is
left of the time of those of 1 KiB and less. The same processes then time, for the model of
``--params`` float32 parameters, what one step of each method sends on ``--workers`` ranks
(DDP's all-reduce, gossip on a ring and on the one-peer exponential graph, through
``lightning_decentral.gossip.Gossip``), and the table sets each against the model's
prediction for that ``n``: how far the model is from the real transport here.

**Extrapolated.** Per-step communication time of each method on ``n`` ranks, ``M`` model bytes,
one NIC per rank, full duplex (a rank sends and receives ``M`` at once), no overlap with compute:

* ``ddp`` all-reduce of the gradients: ring ``2(n-1) alpha + 2(n-1)/n M beta``, or a (double
  binary) tree ``2 log2(n) alpha + 2 M beta``, whichever is faster (NCCL chooses so);
* ``dpsgd`` ring: two neighbours, ``alpha + 2 M beta``; exponential graph: ``d = ceil(log2 n)``
  neighbours, ``alpha + d M beta``; ``one_peer_exponential``: ``alpha + M beta``;
* ``decentlam`` on a ring: as ``dpsgd`` ring plus a latency per bucket, ``B alpha + 2 M beta``,
  ``B = ceil(M / bucket_cap_mb)``;
* ``hierarchical`` (``Hierarchical(inner="complete", outer="one_peer_exponential")``, ``g`` ranks per
  node): an all-reduce on the node's fast link, ``2(g-1) alpha_in + 2(g-1)/g M beta_in``, then the
  one-peer exchange across nodes, ``alpha + M beta``.

Links: those measured here, and stated ones (``alpha`` = one-way small-message latency,
``1 / beta`` = achievable bandwidth): 25 GbE (TCP, 15 µs, 2.9 GB/s), 100 Gbit/s InfiniBand
(RDMA, 2 µs, 12 GB/s), and for the inner level of ``hierarchical`` NVLink (3 µs, 150 GB/s).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness


@dataclass(frozen=True)
class LinkCost:
    name: str
    alpha_s: float  # one-way latency of a small message
    beta_s_per_byte: float  # 1 / bandwidth
    source: str  # "measured ..." or "stated"


STATED = (
    LinkCost("25 GbE (TCP)", 15e-6, 1 / 2.9e9, "stated"),
    LinkCost("100 Gbit/s InfiniBand", 2e-6, 1 / 12e9, "stated"),
)
NVLINK = LinkCost("NVLink (node-local)", 3e-6, 1 / 150e9, "stated")
SIZES = [4 * 4**k for k in range(12)]  # 4 B ... 16 MiB
N_RANGE = [2**k for k in range(3, 11)]  # 8 ... 1024


# -- the model -----------------------------------------------------------------------------------


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """``t = alpha + beta m``: ``beta`` the least-squares slope over the messages of 1 MiB and more
    (the bandwidth regime), ``alpha`` the median of ``t - beta m`` over those of 1 KiB and less (the
    latency regime); a noisy negative value is clamped to 0."""
    import numpy as np

    m, t = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    large, small = m >= 2**20, m <= 2**10
    if large.sum() >= 2:
        beta = float(np.polyfit(m[large], t[large], 1)[0])
    else:  # smoke sizes: all small, one slope through everything
        beta = float(np.polyfit(m, t, 1)[0])
    beta = max(beta, 0.0)
    alpha = max(float(np.median((t - beta * m)[small if small.any() else slice(None)])), 0.0)
    return alpha, beta


def _gbyte_per_s(beta: float) -> str:
    return f"{1 / beta / 1e9:.3f}" if beta > 0 else "inf"


def exponential_degree(n: int) -> int:
    """Out-neighbours of the static exponential graph: offsets 1, 2, 4, ... below ``n``."""
    return sum(1 for k in range(n.bit_length()) if 2**k < n)


def step_seconds(
    method: str,
    n: int,
    model_bytes: float,
    link: LinkCost,
    *,
    bucket_bytes: float = 4 * 2**20,
    ranks_per_node: int = 8,
    inner: LinkCost = NVLINK,
) -> float:
    """Per-step communication time of ``method`` on ``n`` ranks (the formulas of the module docstring)."""
    a, b, m = link.alpha_s, link.beta_s_per_byte, model_bytes
    if method == "ddp":
        ring = 2 * (n - 1) * a + 2 * (n - 1) / n * m * b
        tree = 2 * math.log2(n) * a + 2 * m * b
        return min(ring, tree)
    if method == "ring":
        return a + min(2, n - 1) * m * b
    if method == "exponential":
        return a + exponential_degree(n) * m * b
    if method == "one_peer_exponential":
        return a + m * b
    if method == "decentlam":
        return math.ceil(m / bucket_bytes) * a + min(2, n - 1) * m * b
    if method == "hierarchical":
        g = min(ranks_per_node, n)
        inside = 2 * (g - 1) * inner.alpha_s + 2 * (g - 1) / g * m * inner.beta_s_per_byte
        return inside + (a + m * b if n > g else 0.0)
    raise ValueError(f"unknown method {method!r}")


METHODS = ("ddp", "ring", "exponential", "one_peer_exponential", "decentlam", "hierarchical")


# -- measuring (inside each worker) -------------------------------------------------------------------


def _measure(config: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_decentral.gossip import Gossip
    from lightning_decentral.topology import resolve_topology

    torch.set_num_threads(1)
    harness.quiet()
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    rank, n = dist.get_rank(), dist.get_world_size()
    pingpong = []
    for size in config["sizes"]:
        buffer = torch.zeros(max(1, size // 4))
        reps = config["reps"] if size <= 2**20 else max(2, config["reps"] // 5)
        times = []
        dist.barrier()
        for rep in range(reps + 1):  # the first is a warm-up
            begin = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if rep:
                times.append((time.perf_counter() - begin) / 2)
        pingpong.append(statistics.median(times) if rank == 0 else None)
    model = torch.zeros(config["params"])
    measured: dict[str, list[float]] = {}
    gossips = {name: Gossip(resolve_topology(name, n)) for name in ("ring", "one_peer_exponential")}
    for name in ("ddp", *gossips):
        times = []
        for k in range(config["exchange_reps"] + 1):  # the first is a warm-up
            dist.barrier()
            begin = time.perf_counter()
            if name == "ddp":
                dist.all_reduce(model)
            else:
                gossips[name].start([model], step=k).wait()
            if k:
                times.append(time.perf_counter() - begin)
        measured[name] = times
    dist.destroy_process_group()
    return {"pingpong_s": pingpong, "exchange_s": measured}


# -- the driver ----------------------------------------------------------------------------------


def measure_network(name: str, args: argparse.Namespace) -> dict[str, Any]:
    link = None if name == "loopback" else harness.PROFILES[name]
    spec = dict(sizes=args.sizes, reps=args.reps, params=args.params, exchange_reps=args.exchange_reps)
    with harness.network_or_loopback(link, args.workers) as network:
        records = harness.run_ranks(
            functools.partial(_measure, spec), args.workers, timeout=args.timeout, network=network
        )
        shaping = network.shaping if network is not None else "127.0.0.1 TCP, no shaping"
    alpha, beta = fit_alpha_beta(args.sizes, records[0]["pingpong_s"])
    exchange = {
        method: statistics.median(max(column) for column in zip(*(r["exchange_s"][method] for r in records)))
        for method in records[0]["exchange_s"]
    }
    label = "loopback" if link is None else f"emulated {link.rate_mbit / 1000:g} Gbit/s"
    return {
        "network": name,
        "shaping": shaping,
        "link": asdict(LinkCost(f"{label} (measured)", alpha, beta, "measured")),
        "sizes": args.sizes,
        "pingpong_s": records[0]["pingpong_s"],
        "exchange_s": exchange,
    }


def render(measured: list[dict[str, Any]], links: list[LinkCost], args: argparse.Namespace, command: str) -> str:
    model_bytes = args.params * 4
    lines = [
        f"Command: `{command}`",
        "",
        "Measured links (ping-pong fit, one way):",
        "",
        "| network | shaping | alpha (µs) | 1/beta (GB/s) | largest fit error |",
        "|---|---|---|---|---|",
    ]
    for m in measured:
        link = m["link"]
        errors = [
            abs(link["alpha_s"] + link["beta_s_per_byte"] * s - t) / t for s, t in zip(m["sizes"], m["pingpong_s"])
        ]
        lines.append(
            f"| {m['network']} | {m['shaping']} | {link['alpha_s'] * 1e6:.1f} | "
            f"{_gbyte_per_s(link['beta_s_per_byte'])} | {max(errors):.0%} |"
        )
    lines += [
        "",
        f"One step's exchange of {args.params:,} float32 parameters on {args.workers} ranks, measured "
        "(median of the slowest rank) against the model with the fitted alpha, beta:",
        "",
        "| network | method | measured (s) | model (s) | measured / model |",
        "|---|---|---|---|---|",
    ]
    for m in measured:
        link = LinkCost(**m["link"])
        for method, seconds in m["exchange_s"].items():
            model = step_seconds(method, args.workers, model_bytes, link)
            lines.append(f"| {m['network']} | {method} | {seconds:.4f} | {model:.4f} | {seconds / model:.2f} |")
    shown = [n for n in (8, 64, 1024) if n in N_RANGE]
    lines += [
        "",
        f"Extrapolated per-step communication (ms) for {model_bytes / 1e6:.1f} MB of parameters "
        f"(hierarchical: {args.ranks_per_node} ranks per node on NVLink inside):",
        "",
        "| link | "
        + " | ".join(f"{m} n={n}" for m in ("ddp", "one_peer_exponential", "ring", "hierarchical") for n in shown)
        + " |",
        "|---|" + "---|" * (4 * len(shown)),
    ]
    for link in links:
        cells = [
            f"{step_seconds(m, n, model_bytes, link, ranks_per_node=args.ranks_per_node) * 1e3:.2f}"
            for m in ("ddp", "one_peer_exponential", "ring", "hierarchical")
            for n in shown
        ]
        lines.append(f"| {link.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(links: list[LinkCost], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model_bytes = args.params * 4
    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.8), squeeze=False, sharey=False)
    for ax, link in zip(axes[0], links):
        for method, style in zip(METHODS, ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))):
            ax.plot(
                N_RANGE,
                [step_seconds(method, n, model_bytes, link, ranks_per_node=args.ranks_per_node) * 1e3 for n in N_RANGE],
                linestyle=style,
                marker="o",
                markersize=3,
                label=method,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks n")
        ax.set_title(
            f"{link.name}\nalpha {link.alpha_s * 1e6:.1f} µs, {_gbyte_per_s(link.beta_s_per_byte)} GB/s", fontsize=9
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("communication per step (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(
        f"alpha-beta model, {model_bytes / 1e6:.1f} MB of float32 parameters; hierarchical: "
        f"{args.ranks_per_node} ranks per node, NVLink inside",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--networks",
        default=None,
        help=f"comma-separated: loopback, {', '.join(harness.PROFILES)} (default loopback,1gbit)",
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--params", type=int, default=None, help="model parameters (default: step_time.py's MLP, 5,257,226)"
    )
    parser.add_argument("--reps", type=int, default=20, help="ping-pongs per size (a fifth of that above 1 MiB)")
    parser.add_argument("--exchange-reps", type=int, default=5, help="timed exchanges per method (default 5)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="hierarchical: ranks per node (default 8)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per network")
    parser.add_argument(
        "--png", default=None, help="the figure (default docs/img/benchmarks/cost_model.png; --smoke: none)"
    )
    parser.add_argument("--out", action="append", default=[], help="write results: .md (tables) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="loopback, sizes up to 4 kB, 2 reps, a 1k-parameter model")
    args = parser.parse_args(argv)
    args.sizes = SIZES
    if args.smoke:
        args.networks = args.networks or "loopback"
        args.sizes = [s for s in SIZES if s <= 4096]
        args.reps, args.exchange_reps = 2, 1
        args.params = args.params or 1000
    elif args.png is None:
        args.png = str(harness.ROOT / "docs" / "img" / "benchmarks" / "cost_model.png")
    args.networks = (args.networks or "loopback,1gbit").split(",")
    if args.params is None:
        args.params = harness.count_parameters(harness.FULL_WIDTHS)
    unknown = [n for n in args.networks if n != "loopback" and n not in harness.PROFILES]
    if unknown:
        parser.error(f"unknown networks {unknown}; choose from loopback, {', '.join(harness.PROFILES)}")
    if args.workers < 2 or args.reps < 1 or args.exchange_reps < 1 or args.params < 1 or args.ranks_per_node < 1:
        parser.error("--workers must be >= 2; --reps, --exchange-reps, --params, --ranks-per-node >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if any(n != "loopback" for n in args.networks):
        ok, why = harness.netns_permitted()
        if not ok:
            print(
                f"--networks {','.join(args.networks)} needs network namespaces: {why}. Use --networks loopback.",
                file=sys.stderr,
            )
            return 2
    harness.exit_on_sigterm()
    command = harness.command_line(__file__, argv)
    import lightning_decentral.gossip  # noqa: F401  imported once here, inherited by the forked workers

    started = time.monotonic()
    measured = []
    for name in args.networks:
        measured.append(measure_network(name, args))
        link = measured[-1]["link"]
        print(
            f"[{name}] alpha {link['alpha_s'] * 1e6:.1f} µs, 1/beta {_gbyte_per_s(link['beta_s_per_byte'])} GB/s",
            flush=True,
        )
    links = [LinkCost(**m["link"]) for m in measured] + list(STATED)
    table = render(measured, links, args, command)
    print("\n" + table + f"\n\nwhole run: {time.monotonic() - started:.0f} s")
    if args.png:
        plot(links, args, Path(args.png))
        print(f"wrote {args.png}")
    extrapolated = {
        link.name: {
            m: [step_seconds(m, n, args.params * 4, link, ranks_per_node=args.ranks_per_node) for n in N_RANGE]
            for m in METHODS
        }
        for link in links
    }
    body = {
        "command": command,
        "measured": measured,
        "links": [asdict(link) for link in links],
        "nvlink": asdict(NVLINK),
        "n": N_RANGE,
        "extrapolated_s": extrapolated,
        "params": args.params,
    }
    harness.write_outputs(args.out, body, table, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
