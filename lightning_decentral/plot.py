"""Plot training runs side by side from their CSV or TensorBoard logs.

    python -m lightning_decentral.plot LOG_DIR [LOG_DIR ...] [--out DIR]

Each `LOG_DIR` is searched for Lightning `CSVLogger` files (`metrics.csv`) and TensorBoard event
files (`events.out.tfevents.*`); every one found is a run, named after its directory. One PNG per
quantity, plotted against the optimizer step, one line per run:

* `loss.png`: every metric whose name contains `loss` (e.g. `train_loss`, `val_loss`);
* `accuracy.png`: every metric whose name contains `acc`;
* `consensus_distance.png`: `consensus/distance`, `consensus/relative` and `consensus/residual`
  ([`ConsensusDistance`][lightning_decentral.callbacks.ConsensusDistance]), log scale;
* `effective_lr_ratio.png`: `lr/effective_ratio`
  ([`EffectiveLearningRate`][lightning_decentral.callbacks.EffectiveLearningRate]);
* `gossip_steps.png`: `consensus/gossip_steps`, the gossip rounds each step took
  ([`ConsensusControl`][lightning_decentral.callbacks.ConsensusControl]).

A figure is written only when some run logged one of its metrics. From Python:
`plot_runs(["logs/ring", "logs/complete"], "plots")` returns the paths written.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)]
_INSTALL = "pip install 'lightning-decentral[plot]'"

# (file stem, title, metric selector, log scale)
_FIGURES: list[tuple[str, str, Callable[[str], bool], bool]] = [
    ("loss", "Loss", lambda name: "loss" in name.lower(), False),
    ("accuracy", "Accuracy", lambda name: "acc" in name.lower(), False),
    (
        "consensus_distance",
        "Consensus distance",
        lambda name: name in ("consensus/distance", "consensus/relative", "consensus/residual"),
        True,
    ),
    ("effective_lr_ratio", "Effective learning rate ratio α_e / γ", lambda name: name == "lr/effective_ratio", False),
    ("gossip_steps", "Gossip rounds per step", lambda name: name == "consensus/gossip_steps", False),
]
_AXIS_LABELS = {"consensus/gossip_steps": "gossip rounds (consensus/gossip_steps)"}  # else the metric's name


def read_csv(path: str | Path) -> Series:
    """The metrics of a Lightning `metrics.csv`: `{name: [(step, value), ...]}` (empty cells skipped).

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = Path(folder) / "metrics.csv"
        ...     _ = path.write_text("epoch,step,train_loss,val_loss\\n0,9,0.5,\\n0,9,,0.75\\n0,19,0.25,\\n")
        ...     read_csv(path)
        {'train_loss': [(9, 0.5), (19, 0.25)], 'val_loss': [(9, 0.75)]}
    """
    series: Series = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for name, value in row.items():
                if name in ("step", "epoch") or value in (None, ""):
                    continue
                series.setdefault(name, []).append((int(float(step)), float(value)))
    return series


def read_tensorboard(directory: str | Path) -> Series:
    """The scalars of the TensorBoard event files in `directory`: `{tag: [(step, value), ...]}`."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:
        raise ImportError(f"Reading TensorBoard logs needs the `tensorboard` package: {_INSTALL}") from exc
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(int(event.step), float(event.value)) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
        if tag != "epoch"
    }


def find_runs(log_dir: str | Path) -> list[tuple[str, Series]]:
    """Every run under `log_dir`, as `(label, series)`; a directory holding both a CSV and TensorBoard
    log counts once (the CSV).

    Examples:
        >>> find_runs("no/such/logs")
        Traceback (most recent call last):
        ...
        FileNotFoundError: No log directory 'no/such/logs': pass the save_dir (or a version_N folder) of a logger.
    """
    root = Path(log_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"No log directory {str(root)!r}: pass the save_dir (or a version_N folder) of a logger."
        )
    directories = sorted(
        {p.parent for p in root.rglob("metrics.csv")} | {p.parent for p in root.rglob("events.out.tfevents.*")}
    )
    runs = []
    for directory in directories:
        csv_file = directory / "metrics.csv"
        series = read_csv(csv_file) if csv_file.exists() else read_tensorboard(directory)
        runs.append((_label(root, directory, single=len(directories) == 1), series))
    return runs


def _label(root: Path, directory: Path, single: bool) -> str:
    name = root.resolve().name
    if name.startswith("version_"):
        name = f"{root.resolve().parent.name}/{name}"
    if single or directory == root:
        return name
    return f"{name}/{directory.relative_to(root).as_posix()}"


def plot_runs(log_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write one PNG per quantity found in the runs under `log_dirs` into `out_dir`; return their paths."""
    plt = _pyplot()
    runs = [run for log_dir in log_dirs for run in find_runs(log_dir)]
    if not runs:
        raise FileNotFoundError(
            f"No metrics.csv or events.out.tfevents.* under {[str(d) for d in log_dirs]}: log with Lightning's "
            "CSVLogger or TensorBoardLogger."
        )
    labels = _unique([label for label, _ in runs])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, selects, log_scale in _FIGURES:
        names = sorted({name for _, series in runs for name in series if selects(name)})
        if not names:
            continue
        columns = min(len(names), 3)
        rows = math.ceil(len(names) / columns)
        figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            for label, (_, series) in zip(labels, runs):
                points = sorted(series.get(name, []))
                if points:
                    ax.plot([s for s, _ in points], [v for _, v in points], label=label, linewidth=1.2)
            if log_scale and all(v > 0 for _, series in runs for _, v in series.get(name, [])):
                ax.set_yscale("log")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(_AXIS_LABELS.get(name, name))
            ax.set_title(name, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(names) :]:
            ax.set_visible(False)
        figure.suptitle(title)
        figure.tight_layout()
        path = out / f"{stem}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path)
    return written


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return unique


def _pyplot() -> Any:  # matplotlib.pyplot, imported when first needed (an optional dependency)
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"Plotting needs matplotlib: {_INSTALL}") from exc
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m lightning_decentral.plot LOG_DIR [LOG_DIR ...] [--out DIR]`: the exit status (2 on an error)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_decentral.plot",
        description="Plot loss, accuracy, consensus distance and effective-LR ratio of runs against the step.",
    )
    parser.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="a CSVLogger or TensorBoardLogger directory")
    parser.add_argument("--out", default="plots", help="where to write the PNGs (default: ./plots)")
    args = parser.parse_args(argv)
    try:
        written = plot_runs(args.log_dirs, args.out)
    except (ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
