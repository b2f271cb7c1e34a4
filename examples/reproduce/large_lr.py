"""Zhang et al. (2021): at a large learning rate and batch, D-PSGD on a ring can beat synchronous SGD, and its
effective learning rate α_e/γ falls below 1 early at a large γ while staying near 1 at a small one.

    python examples/reproduce/large_lr.py                      # ~14 min on 2 cores (simulation)
    python examples/reproduce/large_lr.py --smoke              # seconds

Synchronous SGD (the complete graph, adapt-then-combine), D-PSGD on a ring (AWC and ATC) and DecentLaM, over
growing learning rates at a global batch of 512, for β = 0.9 and β = 0: final accuracy of x̄ (mean ± std over
seeds) and the fraction of seeds that diverged; then α_e/γ (ATC, β = 0.9) at γ = 0.1 and 0.8 over the first and
the last fifth of the steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Cell, accuracy_row, median_series, parser, part_mean, plot, run_cells, settings, table, write

METHODS = ("sync", "awc", "atc", "decentlam")


def main(argv: list[str] | None = None) -> None:
    args = settings(parser(__doc__, seeds=10, workers=16, epochs=30).parse_args(argv))
    rates = (0.8,) if args.smoke else (0.1, 0.4, 0.8, 1.6)
    betas = (0.9,) if args.smoke else (0.9, 0.0)
    cells = [
        Cell(f"{m} lr={lr} β={b}", method=m, lr=lr, momentum=b, workers=args.workers, epochs=args.epochs)
        for b in betas
        for lr in rates
        for m in METHODS
    ]
    results = run_cells(cells, args)
    rows = [accuracy_row(cell.label, results[cell.label]) for cell in cells]
    write(args, "large_lr_accuracy.md", table(["cell", "accuracy of x̄", "diverged"], rows))

    # α_e/γ where D-PSGD trains: adapt-then-combine, β = 0.9, at the smallest rate and at 0.8 (where synchronous SGD
    # breaks down and ATC does not; at 1.6 most runs diverge and their ratio says little)
    ratio_cells = [
        Cell(
            f"atc lr={lr} β=0.9, monitored",
            method="atc",
            lr=lr,
            workers=args.workers,
            epochs=args.epochs,
            monitor_every=1,
        )
        for lr in (rates[0] if not args.smoke else 0.1, 0.8)
    ]
    ratios = run_cells(ratio_cells, args)
    rows, curves = [], {}
    for cell in ratio_cells:
        points = median_series(ratios[cell.label], "lr/effective_ratio")
        curves[cell.label] = points
        early, late = part_mean(points, first=True), part_mean(points, first=False)
        rows.append([cell.label, f"{early:.3f}", f"{late:.3f}"])
    write(args, "large_lr_effective_ratio.md", table(["cell", "α_e/γ early", "α_e/γ late"], rows))
    plot(args, "large_lr_effective_ratio.png", curves, "α_e / γ (median over seeds)", ylim=(-0.5, 2.0))


if __name__ == "__main__":
    main()
