"""Median wall time of one optimizer step: Lightning's ``ddp`` against ``DecentralizedStrategy``.

One command regenerates the table in ``docs/benchmarks.md``::

    python benchmarks/step_time.py                 # every method, 30 measured steps after 5 warm-up
    python benchmarks/step_time.py --smoke         # 2 steps, tiny model, 2 methods (< 1 minute)
    python benchmarks/step_time.py --methods ddp,ring,one_peer_exponential --steps 50 --out table.md --out table.json

Every method trains the same MLP (same widths, same per-rank synthetic data, SGD with momentum)
for ``--warmup + --steps`` optimizer steps on ``--workers`` CPU processes over gloo, one method
after another in the same run. Each method gets its own group of processes, spawned with the
environment Lightning's launcher gives its children (``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``), so ``Trainer(devices=n)`` joins instead of
launching.

Timing: a callback takes ``time.perf_counter()`` at every ``on_train_batch_end``; the time of
step ``k`` is the interval between the ends of steps ``k - 1`` and ``k`` (forward, backward,
communication, optimizer step, fetching the batch: everything a training run pays per step).
The first ``--warmup`` steps are dropped; for each remaining step the slowest rank's time is
taken, and the table shows the median (and the interquartile range) of those per-step maxima.

Two rows measure no communication at all, so the reader can see what bounds the others:

* ``single``: one process alone, ``Trainer(devices=1)``, the same steps: compute with a core to itself.
* ``local``: ``--workers`` processes of ``DecentralizedStrategy`` with ``gossip_every`` larger than the
  run, so every step is local: the same processes sharing the same cores, minus the bytes.

Bytes each rank sends per step:

* dpsgd over point-to-point (``ring``, ``torus``, ``exponential``, ``one_peer_exponential``):
  ``strategy._gossip.bytes_sent(strategy.flat_parameters, step)``, i.e. model bytes x the number of
  out-neighbours of ``W(step)``, averaged over the measured steps.
* ``complete`` (one all-reduce of the parameters) and ``ddp`` (all-reduce of the gradients): the
  ring all-reduce figure ``2 (n - 1) / n`` x model bytes. This is a model of the traffic, not a
  count: gloo picks its own all-reduce algorithm. (``Gossip.bytes_sent`` counts an all-reduce as
  one copy of the buffer; the JSON output keeps that figure too.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# -- what is measured ---------------------------------------------------------------------------

FULL_WIDTHS = (1024, 2048, 1024, 1024, 10)  # 5,257,226 parameters
SMOKE_WIDTHS = (64, 64, 10)


@dataclass(frozen=True)
class Method:
    name: str  # the token --methods takes
    label: str  # the table's "method" column
    topology: str  # the table's "topology" column
    strategy: str  # "ddp", "dpsgd", "local" or "single"
    combine: str = "awc"
    dpsgd_topology: str = "ring"


METHODS = {
    m.name: m
    for m in (
        Method("ddp", "ddp", "all-reduce (gradients)", "ddp"),
        Method("ring", "dpsgd awc", "ring", "dpsgd", "awc", "ring"),
        Method("torus", "dpsgd awc", "torus", "dpsgd", "awc", "torus"),
        Method("exponential", "dpsgd awc", "exponential", "dpsgd", "awc", "exponential"),
        Method("one_peer_exponential", "dpsgd awc", "one_peer_exponential", "dpsgd", "awc", "one_peer_exponential"),
        Method("complete", "dpsgd awc", "complete", "dpsgd", "awc", "complete"),
        Method("ring_atc", "dpsgd atc", "ring", "dpsgd", "atc", "ring"),
        Method("local", "dpsgd, no gossip", "none (compute only)", "local"),
        Method("single", "1 process", "none (compute only)", "single"),
    )
}
DEFAULT_METHODS = ",".join(METHODS)
SMOKE_METHODS = "ddp,ring"


def build_mlp(widths: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def count_parameters(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def _make_module(widths: tuple[int, ...], lr: float, momentum: float) -> Any:
    import lightning.pytorch as pl

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # same start everywhere (the strategies broadcast rank 0's anyway)
            self.net = build_mlp(widths)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=momentum)

    return MLP()


def _make_loader(rank: int, widths: tuple[int, ...], batch_size: int, batches: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard, in memory
    x = torch.randn(batch_size * batches, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (batch_size * batches,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False, num_workers=0)


# -- one worker process ----------------------------------------------------------------------------


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker(rank: int, world_size: int, port: int, method: Method, config: dict[str, Any], out: str) -> None:
    """One rank of one method: train, and write this rank's step end times (and bytes) to ``out``."""
    if method.strategy != "single":
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE=str(world_size),
            PL_DISABLE_FORK="1",
        )
    torch.set_num_threads(config["threads"])
    _quiet()
    try:
        result = _train(rank, world_size, method, config)
        status: tuple[str, Any] = ("ok", result)
    except BaseException as exc:  # the parent prints it with the worker's traceback
        status = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    partial = Path(out) / f"{rank}.partial"
    partial.write_text(json.dumps(status))
    os.replace(partial, Path(out) / f"{rank}.json")


def _train(rank: int, world_size: int, method: Method, config: dict[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_decentral import DecentralizedStrategy

    widths = tuple(config["widths"])
    total = config["warmup"] + config["steps"]

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.bytes: list[int] = []
            self.bytes_error: Optional[str] = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())
            strategy = trainer.strategy
            if isinstance(strategy, DecentralizedStrategy) and self.bytes_error is None:
                try:
                    if strategy._gossip is None:
                        raise RuntimeError("strategy._gossip is None during training")
                    step = trainer.global_step
                    rounds = strategy.gossip_rounds(step)
                    self.bytes.append(rounds * strategy._gossip.bytes_sent(strategy.flat_parameters, step))
                except Exception as exc:  # keep timing even if this private API changes
                    self.bytes_error = f"{type(exc).__name__}: {exc}"

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())

    if method.strategy == "ddp":
        strategy: Any = "ddp"
    elif method.strategy == "dpsgd":
        strategy = DecentralizedStrategy(topology=method.dpsgd_topology, combine=method.combine)
    elif method.strategy == "local":  # every step local: W = I is never reached, nothing is sent
        strategy = DecentralizedStrategy(topology="ring", gossip_every=total + 1)
    else:
        strategy = "auto"
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if method.strategy == "single" else world_size,
        strategy=strategy,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    module = _make_module(widths, config["lr"], config["momentum"])
    trainer.fit(module, train_dataloaders=_make_loader(rank, widths, config["batch_size"], total))
    if len(clock.ends) != total:
        raise RuntimeError(f"expected {total} optimizer steps, the callback saw {len(clock.ends)}")
    return {
        "starts": clock.starts,
        "ends": clock.ends,
        "bytes": clock.bytes,
        "bytes_error": clock.bytes_error,
        "parameters": sum(p.numel() for p in module.parameters()),
        "threads": torch.get_num_threads(),
    }


# -- the driver ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_method(method: Method, world_size: int, config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Spawn the ranks of one method, wait for them, return each rank's record."""
    ranks = 1 if method.strategy == "single" else world_size
    context = mp.get_context("spawn")
    out = tempfile.mkdtemp(prefix="step_time_")
    try:
        port = _free_port()
        procs = [
            context.Process(target=_worker, args=(rank, world_size, port, method, config, out)) for rank in range(ranks)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline and not failed:
            failed = any(p.exitcode not in (None, 0) for p in procs) or any(
                json.loads((Path(out) / f"{r}.json").read_text())[0] == "error"
                for r in range(ranks)
                if (Path(out) / f"{r}.json").exists()
            )
            time.sleep(0.05)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:  # one failed rank would leave the others blocked in a collective
            p.kill()
        for p in procs:
            p.join()
        records, errors = [], []
        for r in range(ranks):
            path = Path(out) / f"{r}.json"
            if not path.exists():
                continue
            status, value = json.loads(path.read_text())
            (records if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError(errors[0])
        if len(records) < ranks:
            why = f"still running after {timeout:.0f} s" if alive and not failed else "died without a result"
            raise RuntimeError(f"{method.name}: {ranks - len(records)} of {ranks} ranks {why} "
                               f"(exit codes {[p.exitcode for p in procs]})")
        return records
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _summarize(method: Method, records: list[dict[str, Any]], config: dict[str, Any], world_size: int) -> dict[str, Any]:
    warmup, steps = config["warmup"], config["steps"]
    # step k (k >= 1) takes ends[k] - ends[k-1]; keep the measured ones, the slowest rank per step
    per_rank = [[r["ends"][k] - r["ends"][k - 1] for k in range(warmup, warmup + steps)] for r in records]
    slowest = [max(column) for column in zip(*per_rank)]
    inside = [
        max(r["ends"][k] - r["starts"][k] for r in records) for k in range(warmup, warmup + steps)
    ]  # batch start -> batch end only (excludes fetching the batch)
    parameters = records[0]["parameters"]
    model_bytes = parameters * 4  # float32
    ring_allreduce = 2 * (world_size - 1) / world_size * model_bytes
    gossip_counted: Optional[float] = None
    bytes_error = next((r["bytes_error"] for r in records if r["bytes_error"]), None)
    if method.strategy in ("dpsgd", "local") and not bytes_error:
        per_step = [max(r["bytes"][k] for r in records) for k in range(warmup, warmup + steps)]
        gossip_counted = statistics.mean(per_step)
    if method.strategy == "ddp":
        sent, how = ring_allreduce, "2(n-1)/n x gradient bytes (ring all-reduce model)"
    elif method.strategy == "dpsgd" and method.dpsgd_topology == "complete":
        sent, how = ring_allreduce, "2(n-1)/n x model bytes (ring all-reduce model)"
    elif method.strategy in ("dpsgd", "local"):
        sent = gossip_counted
        how = "Gossip.bytes_sent: model bytes x out-neighbours" if bytes_error is None else f"n/a ({bytes_error})"
    else:
        sent, how = 0.0, "none"
    return {
        "name": method.name,
        "method": method.label,
        "topology": method.topology,
        "ranks": len(records),
        "median_s": statistics.median(slowest),
        "q25_s": _quantile(slowest, 0.25),
        "q75_s": _quantile(slowest, 0.75),
        "median_batch_start_to_end_s": statistics.median(inside),
        "step_times_slowest_rank_s": slowest,
        "bytes_sent_per_rank": sent,
        "bytes_how": how,
        "gossip_bytes_sent_reported": gossip_counted,
        "parameters": parameters,
        "threads_per_process": records[0]["threads"],
    }


def _fmt_bytes(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    return f"{value / 1e6:.1f} MB"


def render_table(rows: list[dict[str, Any]]) -> str:
    ddp = next((r for r in rows if r["name"] == "ddp"), None)
    lines = [
        "| method | topology | processes | median step (s) | IQR (s) | ratio to ddp | sent per rank per step | how the bytes are counted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['median_s'] / ddp['median_s']:.2f}" if ddp else "n/a"
        lines.append(
            f"| {r['method']} | {r['topology']} | {r['ranks']} | {r['median_s']:.3f} | "
            f"{r['q25_s']:.3f}–{r['q75_s']:.3f} | {ratio} | {_fmt_bytes(r['bytes_sent_per_rank'])} | {r['bytes_how']} |"
        )
    return "\n".join(lines)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="measured optimizer steps per method (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped before measuring, >= 1 (default 5)")
    parser.add_argument("--workers", type=int, default=4, help="processes per distributed method (default 4)")
    parser.add_argument("--methods", default=None, help=f"comma-separated, from: {DEFAULT_METHODS} (default: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--widths", default=None, help="MLP widths, e.g. 1024,2048,1024,1024,10 (the default)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per method (default 600)")
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="2 steps, tiny model, methods ddp,ring")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 2 if args.steps is None else args.steps
        args.warmup = 1 if args.warmup is None else args.warmup
        args.methods = SMOKE_METHODS if args.methods is None else args.methods
        args.widths = ",".join(map(str, SMOKE_WIDTHS)) if args.widths is None else args.widths
    args.steps = 30 if args.steps is None else args.steps
    args.warmup = 5 if args.warmup is None else args.warmup
    args.methods = DEFAULT_METHODS if args.methods is None else args.methods
    args.widths = tuple(int(w) for w in (args.widths or ",".join(map(str, FULL_WIDTHS))).split(","))
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (a step's time is measured from the end of the previous one)")
    if args.workers < 2:
        parser.error("--workers must be >= 2")
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {DEFAULT_METHODS}")
    if len(args.widths) < 2:
        parser.error("--widths needs at least an input and an output width")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    config = dict(
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        threads=args.threads,
        widths=list(args.widths),
        lr=args.lr,
        momentum=args.momentum,
    )
    methods = [METHODS[m] for m in args.methods.split(",")]
    parameters = count_parameters(args.widths)
    print(
        f"MLP {'-'.join(map(str, args.widths))}: {parameters:,} parameters ({parameters * 4 / 1e6:.1f} MB float32); "
        f"SGD(lr={args.lr}, momentum={args.momentum}); batch {args.batch_size} per process; "
        f"{args.warmup} warm-up + {args.steps} measured steps; {args.workers} processes on gloo; "
        f"{args.threads} torch thread(s) per process; {os.cpu_count()} CPU cores; torch {torch.__version__}",
        flush=True,
    )
    started = time.monotonic()
    rows = []
    for method in methods:
        if method.strategy == "dpsgd" and method.dpsgd_topology == "torus" and not any(
            args.workers % r == 0 for r in range(2, args.workers // 2 + 1)
        ):
            print(f"  {method.name}: skipped, {args.workers} processes do not make a torus", flush=True)
            continue
        t0 = time.monotonic()
        records = _run_method(method, args.workers, config, args.timeout)
        row = _summarize(method, records, config, args.workers)
        rows.append(row)
        print(f"  {method.name:<22} median {row['median_s']:.4f} s/step  ({time.monotonic() - t0:.0f} s)", flush=True)
    elapsed = time.monotonic() - started
    table = render_table(rows)
    print()
    print(table)
    print(f"\nwhole run: {elapsed:.0f} s")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}",
        "torch": torch.__version__,
        "backend": "gloo",
        "widths": list(args.widths),
        "parameters": parameters,
        "config": config,
        "workers": args.workers,
        "elapsed_s": elapsed,
    }
    for out in args.out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        else:
            path.write_text(table + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
