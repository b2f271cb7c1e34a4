"""Kong et al. (2021): the ring-vs-complete gap grows with n alongside the consensus distance; heterogeneous data
widens it; consensus control in the early phase (with a hand-over) against control throughout.

    python examples/reproduce/consensus.py                     # ~15 min on 2 cores (simulation)
    python examples/reproduce/consensus.py --smoke             # seconds

Ring vs complete at n = 4 .. --workers (global batch 512), IID and Dirichlet(α = 0.1) shards; Ξ/‖x̄‖ over
training; ConsensusControl throughout vs until a third of training (hand-over of a tenth), at a constant
learning rate and with a step decay (×0.1 at half and three quarters of training).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Cell,
    accuracy_row,
    mean_std,
    median_series,
    parser,
    part_mean,
    plot,
    run_cells,
    settings,
    table,
    write,
)

LR = 0.4


def main(argv: list[str] | None = None) -> None:
    args = settings(parser(__doc__, seeds=5, workers=64, epochs=20).parse_args(argv))
    sizes = [n for n in (4, 8, 16, 32, 64) if n <= args.workers]
    e = args.epochs
    cells = [
        Cell(
            f"{topology} n={n} {'IID' if alpha is None else f'α={alpha}'}",
            method="awc" if topology == "ring" else "sync",
            workers=n,
            lr=LR,
            epochs=e,
            alpha=alpha,
            monitor_every=1,
        )
        for alpha in (None, 0.1)
        for n in sizes
        for topology in ("ring", "complete")
    ]
    results = run_cells(cells, args)
    rows, curves = [], {}
    for n in sizes:
        for alpha in (None, 0.1):
            data = "IID" if alpha is None else f"α={alpha}"
            ring, complete = results[f"ring n={n} {data}"], results[f"complete n={n} {data}"]
            gap = [c["accuracy"] - r["accuracy"] for r, c in zip(ring, complete)]
            xi = median_series(ring, "consensus/relative")
            curves[f"ring n={n} {data}"] = xi
            rows.append(
                [
                    f"n={n} {data}",
                    mean_std([r["accuracy"] for r in ring]),
                    mean_std([c["accuracy"] for c in complete]),
                    mean_std(gap),
                    f"{part_mean(xi, first=False, fraction=1.0):.4f}",
                ]
            )
    write(
        args,
        "consensus_gap.md",
        table(["cell", "ring", "complete", "gap (complete − ring)", "mean Ξ/‖x̄‖ (ring)"], rows),
    )
    plot(args, "consensus_distance.png", curves, "Ξ / ‖x̄‖", log=True)

    n = sizes[-1]
    target = 0.5 * part_mean(curves[f"ring n={n} IID"], first=False, fraction=1.0)  # half the uncontrolled level
    control_cells = []
    for decay, milestones in (("constant", ()), ("step decay", (max(1, e // 2), max(2, 3 * e // 4)))):
        for when, control in (
            ("throughout", {}),
            ("early", {"until_epoch": max(1, e // 3), "handover_epochs": max(1, e // 10)}),
        ):
            control_cells.append(
                Cell(
                    f"ring n={n} {decay}, control {when}",
                    workers=n,
                    lr=LR,
                    epochs=e,
                    milestones=milestones,
                    control={"target": target, "reference": "parameters", **control},
                )
            )
    controlled = run_cells(control_cells, args)
    rows = [accuracy_row(cell.label, controlled[cell.label]) for cell in control_cells]
    write(args, "consensus_control.md", table(["cell", "accuracy of x̄", "diverged"], rows))
    plot(
        args,
        "consensus_control.png",
        {c.label: median_series(controlled[c.label], "consensus/relative") for c in control_cells},
        "Ξ / ‖x̄‖",
        log=True,
        levels={f"target Ξ/‖x̄‖ = {target:.4f}": target},
    )


if __name__ == "__main__":
    main()
