"""Yuan et al. (2021): DecentLaM's lead over DmSGD grows with the batch size; beside it, the quadratic bias check.

    python examples/reproduce/decentlam.py                     # ~12 min on 2 cores (simulation)
    python examples/reproduce/decentlam.py --smoke             # seconds

DecentLaM vs DmSGD (AWC and ATC forms) vs synchronous momentum SGD on a ring, global batch 256 to 2048, at a fixed
learning rate and at one scaled with the batch (γ = 0.1 · B / 256), on the digits and their one-pixel shifts (7,190
training samples: the 1,438 alone would be less than one batch of 2,048). The bias check: heterogeneous quadratics
f_i(x) = ½(x − b_i)² on a ring of 16, full gradients, β = 0.9: the distance of the fixed point to the optimum mean(b).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Cell, accuracy_row, parser, plot, run_cells, settings, table, write

from lightning_decentral.topology import Ring

METHODS = ("sync", "awc", "atc", "decentlam")


def fixed_point_error(method: str, n: int = 16, lr: float = 0.05, beta: float = 0.9, steps: int = 3000) -> float:
    """RMS distance of the replicas from mean(b) after `steps` full-gradient steps (the bias at the fixed point)."""
    w = Ring(world_size=n).mixing(0)
    b = np.random.default_rng(0).normal(size=n)
    x, m = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        g = x - b
        if method == "decentlam":  # g̃ = (x − W (x − γ g)) / γ
            m = beta * m + (x - w @ (x - lr * g)) / lr
            x = x - lr * m
        elif method == "atc":
            m = beta * m + g
            x = w @ (x - lr * m)
        else:  # awc
            m = beta * m + g
            x = w @ x - lr * m
    return float(np.sqrt(np.mean((x - b.mean()) ** 2)))


def main(argv: list[str] | None = None) -> None:
    args = settings(parser(__doc__, seeds=10, workers=16, epochs=8).parse_args(argv))
    batches = (256,) if args.smoke else (256, 512, 1024, 2048)
    cells = []
    for batch in batches:
        for mode, lr in (("fixed", 0.1), ("scaled", 0.1 * batch / 256))[: 1 if batch == 256 else 2]:  # 256: the same γ
            cells += [
                Cell(
                    f"{m} B={batch} γ {mode}={lr:g}",
                    method=m,
                    global_batch=batch,
                    lr=lr,
                    workers=args.workers,
                    epochs=args.epochs,
                    shifted=True,
                )
                for m in METHODS
            ]
    results = run_cells(cells, args)
    rows = [accuracy_row(cell.label, results[cell.label]) for cell in cells]
    write(args, "decentlam_accuracy.md", table(["cell", "accuracy of x̄", "diverged"], rows))
    for mode in ("fixed", "scaled"):
        curves = {
            m: [
                (c.global_batch, statistics.mean(r["accuracy"] for r in results[c.label]))
                for c in cells
                if c.method == m and (mode in c.label or c.global_batch == 256)
            ]
            for m in METHODS
        }
        plot(
            args,
            f"decentlam_accuracy_{mode}.png",
            curves,
            f"accuracy of x̄, γ {mode} (mean over seeds)",
            xlabel="global batch",
            markers=True,
        )
    bias = [[m, f"{fixed_point_error(m, steps=200 if args.smoke else 3000):.4f}"] for m in ("awc", "atc", "decentlam")]
    write(args, "decentlam_bias.md", table(["rule (β = 0.9, ring of 16)", "RMS distance to mean(b)"], bias))


if __name__ == "__main__":
    main()
