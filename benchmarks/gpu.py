"""One GPU: the CUDA and bf16 paths of the strategies, and the simulation's speed and memory at n workers.

    python benchmarks/gpu.py --out gpu.json --out gpu.md        # a CUDA machine: n = 16, 32, 64
    python benchmarks/gpu.py --sections arithmetic,compressed --out gpu_compressed.json --out gpu_compressed.md
    python benchmarks/gpu.py --smoke --out smoke.json           # any machine, seconds (tests/test_benchmarks_smoke.py)

Everything runs in this process, one fresh Trainer after the other, on the digits MLP of ``simulate.py``
(64-128-128-10, momentum SGD, lr 0.1, a global batch of 512 samples, ring, AWC), and for ``sim`` also on ``ResNet20``
(convolutions without bias, each followed by BatchNorm, on 32 x 32 images; a global batch of 1024 synthetic images):

* ``paths``: ``DecentralizedStrategy`` (D-PSGD and DecentLaM) on one device (``devices=1``, one process) under
  ``32-true`` and ``bf16-mixed``: the loss stays finite, ``trainer.save_checkpoint`` writes ``x̄`` and the shard,
  and ``fit(ckpt_path=...)`` resumes from them.
* ``lightning``: a plain ``Trainer(devices=1)`` on the whole global batch, no decentralized strategy: the baseline of
  both the step time and the memory columns.
* ``sim``: ``SimulatedDecentralizedStrategy(workers=n)``, the workers apart (``vectorize=False``) and stacked
  (``vectorize=True``), under both precisions. A step's time is the gap between the ends of two optimizer steps (the
  GPU synchronized first), the median after ``--warmup`` steps; the ratio is to ``lightning``'s in the same
  precision and run. Memory: ``torch.cuda.max_memory_allocated`` over the run minus ``lightning``'s, per worker
  (``None`` on the CPU).
* ``arithmetic``: one step of the CHOCO arithmetic of each of ``--compressions``
  (``benchmarks/compressor_arithmetic.py``: one worker of one-peer gossip, its message and its neighbour's) on flat
  buffers of ``--arithmetic-numel`` elements (default 10M, 100M, 1B float32) against a device-to-device ``copy_`` of
  the buffer, wall time with the device synchronized.
* ``compressed``: the simulation with ``compression=`` each of ``--compressions`` (workers apart: stacked workers do
  not compress), the MLP in 32-true, at each n, against ``lightning`` and against the same simulation uncompressed
  in the same run.

``--sections`` picks among ``paths``, ``simulation``, ``arithmetic``, ``compressed`` (default: all).

A run that fails is recorded with its error and the others go on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from compressor_arithmetic import measure as measure_arithmetic
from mlp import MLP, digits, digits_loader, quiet_trainer

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy


class ResNet20(pl.LightningModule):
    """ResNet-20 for 32 x 32 images (He et al. 2016, section 4.2): a 3x3 convolution to ``width`` channels, three stages
    of three basic blocks (``width``, ``2 width``, ``4 width`` channels; stride 2 into stages 2 and 3, with a 1x1
    convolution shortcut there), global average pooling and a linear layer to 10 classes: 19 convolutions and a linear
    layer (and the two shortcuts), every convolution without bias and followed by BatchNorm; 0.27 M parameters at
    ``width=16``. Cross-entropy, SGD(lr=0.1, momentum=0.9)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [_conv_bn(3, width, 3, stride=1), torch.nn.ReLU()]
        channels = width
        for stage in range(3):
            for block in range(3):
                layers.append(_BasicBlock(channels, width * 2**stage, stride=2 if stage and not block else 1))
                channels = width * 2**stage
        head = [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)]
        self.net = torch.nn.Sequential(*layers, *head)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _BasicBlock(torch.nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            _conv_bn(inputs, outputs, 3, stride), torch.nn.ReLU(), _conv_bn(outputs, outputs, 3, stride=1)
        )
        same = stride == 1 and inputs == outputs
        self.shortcut = torch.nn.Identity() if same else _conv_bn(inputs, outputs, 1, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _conv_bn(inputs: int, outputs: int, kernel: int, stride: int) -> torch.nn.Sequential:
    """A ``kernel x kernel`` convolution without bias (padded to keep the size at stride 1), then BatchNorm."""
    conv = torch.nn.Conv2d(inputs, outputs, kernel, stride=stride, padding=kernel // 2, bias=False)
    return torch.nn.Sequential(conv, torch.nn.BatchNorm2d(outputs))


def _images(size: int, samples: int, batch: int) -> torch.utils.data.DataLoader:
    """``samples`` synthetic images of ``3 x size x size`` (standard normal) with labels in ``0..9``, from a fixed
    seed."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, size, size, generator=generator)
    y = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True
    )


class SyncedClock(pl.Callback):
    """``perf_counter()`` at the end of every optimizer step, after the device has finished it, and the device the
    module trained on (Lightning moves it back to the CPU when fit ends)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.device = ""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        self.device = str(module.device)


def _peak_mb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _fit(
    strategy: Any,
    args: argparse.Namespace,
    precision: str,
    batch: int,
    steps: int,
    ckpt_path: str | None = None,
    model: str = "mlp",
) -> dict[str, Any]:
    """One fit of ``model`` (``"mlp"`` or ``"resnet20"``) up to optimizer step ``steps``: its median step time and peak
    memory, and the Trainer."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    clock = SyncedClock()
    trainer = quiet_trainer(strategy, steps, [clock], accelerator=args.accelerator, devices=1, precision=precision)
    if model == "resnet20":  # 8 steps of data per epoch
        module, loader = ResNet20(args.conv_width), _images(args.image_size, 8 * args.conv_global_batch, batch)
    else:
        x, y = digits()
        module, loader = MLP(tuple(args.widths), 0.1, 0.9), digits_loader(x, y, batch)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][args.warmup - 1 :]
    return {
        "step_s": statistics.median(gaps) if gaps else None,
        "peak_mb": _peak_mb(),
        "trainer": trainer,
        "device": clock.device,
    }


def check_paths(args: argparse.Namespace) -> list[dict[str, Any]]:
    """D-PSGD and DecentLaM on one device, both precisions: finite parameters, a checkpoint written and resumed."""
    rows = []
    for momentum in ("local", "decentlam"):
        for precision in args.precisions:
            row: dict[str, Any] = {"momentum": momentum, "precision": precision}
            try:
                with tempfile.TemporaryDirectory() as directory:
                    path = str(Path(directory) / "x.ckpt")
                    run = _fit(DecentralizedStrategy(momentum=momentum), args, precision, 64, 3)
                    first = run["trainer"]
                    first.save_checkpoint(path)
                    row["device"] = run["device"]
                    row["finite"] = all(bool(torch.isfinite(p).all()) for p in first.lightning_module.parameters())
                    resumed = _fit(DecentralizedStrategy(momentum=momentum), args, precision, 64, 5, ckpt_path=path)[
                        "trainer"
                    ]
                    row["resumed_at"], row["ended_at"] = 3, resumed.global_step
                    row["ok"] = row["finite"] and resumed.global_step == 5
            except Exception as exc:  # recorded: the other runs go on
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return rows


def measure_simulation(args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each model and precision: the plain Trainer, then the simulation at each n, apart and stacked."""
    rows = []
    steps = args.warmup + args.steps
    for model, precision in [(model, precision) for model in args.models for precision in args.precisions]:
        global_batch = args.conv_global_batch if model == "resnet20" else args.global_batch
        base = _fit("auto", args, precision, global_batch, steps, model=model)
        base_row = {
            "model": model,
            "kind": "lightning",
            "n": 1,
            "precision": precision,
            "device": base["device"],
            "step_s": base["step_s"],
            "peak_mb": base["peak_mb"],
        }
        rows.append(base_row)
        print(json.dumps(base_row), flush=True)
        for n in args.workers:
            for vectorize in (False, True):
                row: dict[str, Any] = {
                    "model": model,
                    "kind": "stacked" if vectorize else "apart",
                    "n": n,
                    "precision": precision,
                }
                try:
                    strategy = SimulatedDecentralizedStrategy(workers=n, topology="ring", vectorize=vectorize)
                    run = _fit(strategy, args, precision, global_batch // n, steps, model=model)
                    row.update(step_s=run["step_s"], peak_mb=run["peak_mb"], device=run["device"])
                    row["ratio_to_lightning"] = run["step_s"] / base["step_s"]
                    if run["peak_mb"] is not None and base["peak_mb"] is not None:
                        row["mb_per_worker"] = (run["peak_mb"] - base["peak_mb"]) / n
                except Exception as exc:  # recorded: the other runs go on
                    row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return rows


def measure_compressed(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The MLP's simulation at each n, uncompressed and with each compressor (workers apart), against the Trainer."""
    steps, rows = args.warmup + args.steps, []
    base = _fit("auto", args, "32-true", args.global_batch, steps)
    for n in args.workers:
        plain = None
        for compression in [None, *args.compressions]:
            row: dict[str, Any] = {"n": n, "compression": compression or "none"}
            try:
                strategy = SimulatedDecentralizedStrategy(
                    workers=n, topology="one_peer_ring", vectorize=False, compression=compression
                )
                run = _fit(strategy, args, "32-true", args.global_batch // n, steps)
                row.update(
                    step_s=run["step_s"], device=run["device"], ratio_to_lightning=run["step_s"] / base["step_s"]
                )
                plain = run["step_s"] if compression is None else plain
                row["ratio_to_uncompressed"] = run["step_s"] / plain if plain else None
            except Exception as exc:  # recorded: the other runs go on
                row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return rows


def render(result: dict[str, Any]) -> str:
    """The markdown tables of ``docs/benchmarks.md``."""
    lines = [f"Device: {result['device']}; torch {result['torch']}, lightning {result['lightning']}.", ""]

    def number(value: Any, scale: float = 1.0, digits: int = 2) -> str:
        return "" if value is None else f"{value * scale:.{digits}f}"

    if "arithmetic" in result:
        lines += ["| elements | arithmetic of one step | median (ms) | / copy_ of the buffer |", "|---|---|---|---|"]
        for r in result["arithmetic"]:
            lines.append(
                f"| {r['numel']:,} | {r['compressor']} | {number(r['median_s'], 1e3)} | {number(r['ratio_to_copy'])} |"
            )
        lines.append("")
    if "compressed" in result:
        lines += [
            "| n | compression | median step (ms) | × plain Trainer | × uncompressed simulation | error |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["compressed"]:
            lines.append(
                f"| {r['n']} | {r['compression']} | {number(r.get('step_s'), 1e3)} | "
                f"{number(r.get('ratio_to_lightning'))} | {number(r.get('ratio_to_uncompressed'))} | "
                f"{r.get('error', '')} |"
            )
        lines.append("")
    if "paths" not in result:
        return "\n".join(lines) + "\n"
    lines += [
        "| rule | precision | device | finite after 3 steps | resumed at 3, ended at | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["paths"]:
        lines.append(
            f"| {r['momentum']} | {r['precision']} | {r.get('device', '')} | {r.get('finite', '')} | "
            f"{r.get('resumed_at', '')}, {r.get('ended_at', '')} | {r.get('error', '')} |"
        )
    lines += [
        "",
        "| model | run | n | precision | device | median step (ms) | × plain Trainer | peak memory (MB) | MB per "
        "worker | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.get("simulation", []):
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['n']} | {r['precision']} | {r.get('device', '')} | "
            f"{number(r.get('step_s'), 1e3)} | {number(r.get('ratio_to_lightning'))} | "
            f"{number(r.get('peak_mb'), digits=1)} | {number(r.get('mb_per_worker'), digits=2)} | {r.get('error', '')} "
            "|"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", default="16,32,64", help="comma-separated n (default 16,32,64)")
    parser.add_argument("--precisions", default="32-true,bf16-mixed")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring, >= 1 (default 5)")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--models", default="mlp,resnet20", help="the simulation's models (default mlp,resnet20)")
    parser.add_argument("--conv-global-batch", type=int, default=1024, help="resnet20's global batch (default 1024)")
    parser.add_argument("--sections", default="paths,simulation,arithmetic,compressed", help="what to run (all)")
    parser.add_argument("--compressions", default="sign,int4,top_k:0.01", help="compressors of the compressed runs")
    parser.add_argument("--arithmetic-numel", default="10000000,100000000,1000000000", help="buffer sizes")
    parser.add_argument("--arithmetic-repeats", type=int, default=5, help="timed steps per compressor (default 5)")
    parser.add_argument("--out", action="append", default=[], help=".json or .md; repeatable")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="n = 4, 32-true, 2 + 2 steps, a 64-16-10 MLP, resnet20 of width 4 on 8 x 8 images, batch 16",
    )
    args = parser.parse_args(argv)
    args.workers = [int(n) for n in args.workers.split(",")]
    args.precisions = args.precisions.split(",")
    args.models = args.models.split(",")
    args.sections, args.compressions = args.sections.split(","), args.compressions.split(",")
    args.arithmetic_numel = [int(n) for n in args.arithmetic_numel.split(",")]
    args.widths, args.conv_width, args.image_size = (64, 128, 128, 10), 16, 32
    if args.smoke:
        args.workers, args.precisions, args.steps, args.warmup, args.widths = [4], ["32-true"], 2, 2, (64, 16, 10)
        args.conv_width, args.image_size, args.conv_global_batch = 4, 8, 16
        args.arithmetic_numel, args.arithmetic_repeats = [4099], 2
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {"device": device, "torch": torch.__version__, "lightning": pl.__version__}
    arithmetic_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sections = {
        "paths": lambda: check_paths(args),
        "simulation": lambda: measure_simulation(args),
        "arithmetic": lambda: [
            row
            for numel in args.arithmetic_numel
            for row in measure_arithmetic(numel, args.compressions, args.arithmetic_repeats, arithmetic_device)
        ],
        "compressed": lambda: measure_compressed(args),
    }
    for name in args.sections:
        result[name] = sections[name]()
    for out in args.out:
        Path(out).write_text(render(result) if out.endswith(".md") else json.dumps(result, indent=1))
    print(render(result))
    failed = [r for r in result.get("paths", []) if not r["ok"]] + [
        r for name in ("simulation", "compressed") for r in result.get(name, []) if "error" in r
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
