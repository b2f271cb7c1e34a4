"""What `outer_overlap=True` hides: gossip with an outer optimizer on processes over an emulated slow link, the
round's exchange waited for at the round's end (`outer_overlap=False`) or in flight during the next round (`True`).

    python benchmarks/outer_overlap.py                        # 4 hosts on 100 Mbit/s (root, Linux), 2 repeats
    python benchmarks/outer_overlap.py --profile loopback     # no emulated network
    python benchmarks/outer_overlap.py --smoke                # loopback, a tiny model, a few steps

Every rank is a host of `harness.EmulatedNetwork` (as in `netns.py`: `Trainer(num_nodes=n, devices=1)`, gloo over
the shaped `eth0`). Both modes run in the same processes, one `Trainer.fit` after the other, their order swapped from
repeat to repeat: the MLP of `step_time.py` (`--widths`), SGD with momentum inside, the outer step
`SGD(lr=0.7, momentum=0.9, nesterov=True)` every `--every` steps over `one_peer_exponential` gossip. One round of
warm-up, then `--rounds` rounds measured. Per rank: the wall time of the measured steps (from the end of the warm-up's
last step to the end of the last step) and the time blocked in the exchanges' `wait` within them (an
`ExchangeObserver`: `waited − wait_started`; with overlap, the last round's exchange is waited for when training ends,
outside the measured steps, and not counted). Reported: the slowest rank's mean step time and blocked time per round,
and the ratio of overlap's to the run without it, measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import harness

NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def _fit(overlap: bool, config: dict[str, Any], rank: int, world_size: int) -> dict[str, float]:
    """One fit of one mode on this rank: its measured seconds and the seconds blocked in `wait` during them."""
    import torch
    from mlp import MLP, StepClock, make_loader, quiet_trainer

    from lightning_decentral import DecentralizedStrategy
    from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver

    waits: list[tuple[float, float]] = []

    class Waits(ExchangeObserver):
        def on_wait(self, event: ExchangeEvent) -> None:
            waits.append((event.wait_started, event.waited))

    every, widths = config["every"], tuple(config["widths"])
    total = every * (1 + config["rounds"])
    strategy = DecentralizedStrategy(
        topology="one_peer_exponential",
        gossip_every=every,
        outer_overlap=overlap,
        outer_optimizer=functools.partial(torch.optim.SGD, **NESTEROV),
    )
    strategy.observe(Waits())
    clock = StepClock()
    trainer = quiet_trainer(
        strategy,
        total,
        [clock],
        num_nodes=world_size,
        devices=1,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(
        MLP(widths, lr=0.01, momentum=0.9), train_dataloaders=make_loader(rank, widths, config["batch_size"], total)
    )
    start, end = clock.ends[every - 1], clock.ends[-1]
    blocked = sum(done - began for began, done in waits if start <= began <= end)
    return {"seconds": end - start, "blocked": blocked}


def _work(config: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    harness.use_threads(config["threads"])
    harness.quiet()
    world_size = int(os.environ["WORLD_SIZE"])
    runs = []
    for repeat in range(config["repeats"]):
        for overlap in (False, True) if repeat % 2 == 0 else (True, False):
            runs.append({"overlap": overlap, **_fit(overlap, config, rank, world_size)})
    return runs


def summarize(records: list[list[dict[str, Any]]], config: dict[str, Any]) -> dict[str, Any]:
    """Per mode, over the repeats: the slowest rank's mean step time and blocked seconds per round (medians)."""
    steps, rounds = config["every"] * config["rounds"], config["rounds"]
    modes: dict[bool, dict[str, list[float]]] = {
        False: {"step_s": [], "blocked_per_round_s": []},
        True: {"step_s": [], "blocked_per_round_s": []},
    }
    for i, run in enumerate(records[0]):
        ranks = [r[i] for r in records]
        modes[run["overlap"]]["step_s"].append(max(r["seconds"] for r in ranks) / steps)
        modes[run["overlap"]]["blocked_per_round_s"].append(max(r["blocked"] for r in ranks) / rounds)
    out = {
        ("overlap" if m else "no_overlap"): {k: {"median": statistics.median(v), "runs": v} for k, v in d.items()}
        for m, d in modes.items()
    }
    out["ratio"] = {
        k: out["overlap"][k]["median"] / out["no_overlap"][k]["median"] for k in ("step_s", "blocked_per_round_s")
    }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--profile", default="100mbit", choices=[*harness.PROFILES, "loopback"])
    parser.add_argument("--widths", default="", help="the MLP's widths (default: step_time.py's, 5.3M parameters)")
    parser.add_argument(
        "--every",
        type=int,
        default=15,
        help="H, the inner steps of a round (odd: one_peer_exponential's period on 4 is 2)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds measured (after one of warm-up)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--smoke", action="store_true", help="loopback, 2 workers, a tiny model, H = 2, 1 repeat")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.profile, args.every, args.rounds, args.repeats = 2, "loopback", 2, 2, 1
    harness.exit_on_sigterm()
    widths = harness.parse_widths(args.widths, args.smoke)
    config = {
        "widths": widths,
        "every": args.every,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    import mlp  # noqa: F401  (imported once here, inherited by the forked ranks)

    link = None if args.profile == "loopback" else harness.PROFILES[args.profile]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    started = time.monotonic()
    with harness.network_or_loopback(link, args.workers) as network:
        shaping = network.shaping if network is not None else "loopback"
        records = harness.run_ranks(
            functools.partial(_work, config), args.workers, timeout=args.timeout, network=network
        )
    result = summarize(records, config)
    result["meta"] = {
        **config,
        "workers": args.workers,
        "profile": args.profile,
        "shaping": shaping,
        "parameters": harness.count_parameters(widths),
        "load_average": load,
        "wall_s": time.monotonic() - started,
        "command": harness.command_line(__file__, argv),
    }
    print(f"{args.workers} hosts, {shaping}; {result['meta']['parameters']:,} parameters, H = {args.every}")
    for mode in ("no_overlap", "overlap"):
        row = result[mode]
        print(
            f"{mode:>10}: step {row['step_s']['median']:.4f} s, blocked {row['blocked_per_round_s']['median']:.3f} s "
            "per round"
        )
    print(f"     ratio: step {result['ratio']['step_s']:.3f}, blocked {result['ratio']['blocked_per_round_s']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
