"""`SimulatedDecentralizedStrategy` at n workers in one process, against n gloo processes and a bare loop.

One command regenerates the table in ``docs/benchmarks.md``::

    python benchmarks/simulate.py                        # n = 8, 16, 64; 3 repeats of 5 warm-up + 30 measured steps
    python benchmarks/simulate.py --smoke                # n = 4, 2 steps, tiny MLP (seconds after the imports)
    python benchmarks/simulate.py --workers 8,64 --repeats 1 --out table.md --out results.json

The research set-up: scikit-learn's digits (``sklearn.datasets.load_digits``: 1797 samples, 64
features standardized, 10 classes; no download), an MLP 64-128-128-10 with ReLU, cross-entropy,
``SGD(lr=0.1, momentum=0.9)``, a global batch of ``--global-batch`` (512) samples, i.e.
``512 // n`` per worker, ring topology, D-PSGD with AWC. Every run below is its own fresh Python
process (fair start-up, its own memory high-water mark) with ``--threads`` torch threads:

* ``sim``: ``Trainer(strategy=SimulatedDecentralizedStrategy(workers=n, vectorize=False), accelerator="cpu",
  devices=1)`` on one DataLoader (``shuffle=True, drop_last=True``, batch ``512 // n``); Lightning's
  ``DistributedSampler`` gives worker ``i`` rank ``i``'s shard, as on processes.
* ``vectorized``: the same with ``vectorize=True`` (stacked parameters, one ``torch.vmap`` of
  ``training_step``, one optimizer step and one update rule for all workers).
* ``processes``: ``DecentralizedStrategy`` on ``--processes`` (8) gloo processes on loopback,
  started by ``harness.run_ranks`` (forked from the run's process once it has imported torch,
  lightning and the data), ``Trainer(devices=n)``, the same DataLoader on every rank.
* ``bare``: the floor, no Lightning: the parameters stacked ``[n, ...]``, ``torch.vmap`` of
  ``torch.func.grad`` of the per-worker loss (``torch.func.functional_call``), momentum SGD by hand
  and AWC, ``x <- W x_old + (U(x_old) - x_old)`` with the dense ring ``W`` (``torch.einsum`` over the
  worker axis); its minibatches are the sim's (the same ``DistributedSampler`` indices).
* ``lightning``: the same model under a plain ``Trainer(devices=1)`` (no decentralized strategy),
  one worker with the whole global batch: the baseline of the memory column.

Timing: ``time.perf_counter()`` at the end of every optimizer step (``on_train_batch_end`` in the
Lightning runs, after the update in the bare loop); a step's time is the gap between the ends of
steps ``k - 1`` and ``k`` (on processes, the slowest rank's), the first ``--warmup`` dropped; the
medians are of the measured steps of all repeats pooled. *To first step*: from just before the
model, strategy and Trainer are built (after the imports and the data; on processes, before the
ranks are forked) to the end of the first optimizer step. *Imports*: from the launch of the run's
process to that point. Memory: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of the run's process
at its end (for processes: of each rank, whose resident pages include what it shares with the
others); *MB per worker* of the sim is ``(peak(sim) - peak(lightning)) / n``.

The first repeat also checks that ``bare`` computes the update of both simulations: it runs both at every ``n``
with the same initial model and batches and reports the largest difference of the final
parameters over the workers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import harness

WIDTHS = (64, 128, 128, 10)
SIMULATIONS = ("sim", "vectorized")  # SimulatedDecentralizedStrategy one worker at a time, and vectorize=True
SMOKE_WIDTHS = (64, 16, 10)


# -- inside one run's process ---------------------------------------------------------------------------


def _maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def _lightning(job: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    """``sim`` or ``vectorized`` (n workers), or ``lightning`` (no strategy, the whole batch): one process,
    ``devices=1``."""
    import torch
    from mlp import MLP, StepClock, digits_loader, quiet_trainer

    from lightning_decentral import SimulatedDecentralizedStrategy

    n, total = job["n"], job["warmup"] + job["steps"]
    t0 = time.perf_counter()
    wall0 = time.time()
    if job["kind"] in SIMULATIONS:
        strategy: Any = SimulatedDecentralizedStrategy(
            workers=n, topology="ring", combine="awc", momentum="local", vectorize=job["kind"] == "vectorized"
        )
    else:
        strategy = "auto"
    clock = StepClock()
    trainer = quiet_trainer(strategy, total, [clock], devices=1, num_sanity_val_steps=0)
    module = MLP(tuple(job["widths"]), job["lr"], job["momentum"])
    trainer.fit(module, train_dataloaders=digits_loader(x, y, job["global_batch"] // n))
    if len(clock.ends) != total:
        raise RuntimeError(f"expected {total} optimizer steps, the callback saw {len(clock.ends)}")
    out: dict[str, Any] = {"ends": [clock.ends], "t0": t0, "wall0": wall0}
    if job.get("save") and job["kind"] in SIMULATIONS:
        modules = strategy.worker_modules()
        torch.save(
            {
                name: torch.stack([dict(m.net.named_parameters())[name].detach() for m in modules])
                for name, _ in module.net.named_parameters()
            },
            job["save"],
        )
    return out


def _rank(job: dict[str, Any], x: Any, y: Any, rank: int) -> dict[str, Any]:
    """One rank of ``DecentralizedStrategy`` on ``n`` processes."""
    from mlp import MLP, StepClock, digits_loader, quiet_trainer

    from lightning_decentral import DecentralizedStrategy

    harness.use_threads(job["threads"])
    harness.quiet()
    total = job["warmup"] + job["steps"]
    clock = StepClock()
    strategy = DecentralizedStrategy(topology="ring", combine="awc", momentum="local")
    trainer = quiet_trainer(strategy, total, [clock], devices=job["n"], num_sanity_val_steps=0)
    module = MLP(tuple(job["widths"]), job["lr"], job["momentum"])
    trainer.fit(module, train_dataloaders=digits_loader(x, y, job["global_batch"] // job["n"]))
    if len(clock.ends) != total:
        raise RuntimeError(f"expected {total} optimizer steps, the callback saw {len(clock.ends)}")
    return {"ends": clock.ends, "maxrss_mb": _maxrss_mb()}


def _processes(job: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    import functools

    t0 = time.perf_counter()
    wall0 = time.time()
    records = harness.run_ranks(
        functools.partial(_rank, job, x, y),
        job["n"],
        timeout=job["timeout"],
        one_node=True,
        start_method=job["start_method"],
    )
    return {
        "ends": [r["ends"] for r in records],
        "t0": t0,
        "wall0": wall0,
        "rank_maxrss_mb": [r["maxrss_mb"] for r in records],
    }


def _worker_batches(n: int, batch: int, samples: int, steps: int) -> list[Any]:
    """Per step, a ``[n, batch]`` index tensor: worker ``i``'s batch as Lightning's ``DistributedSampler`` (rank ``i``
    of ``n``, ``shuffle=True``, seed 0, ``set_epoch`` each epoch) and a ``drop_last`` DataLoader give it to the sim."""
    import torch
    from torch.utils.data.distributed import DistributedSampler

    samplers = [DistributedSampler(range(samples), num_replicas=n, rank=i, shuffle=True, seed=0) for i in range(n)]
    per_epoch = len(samplers[0]) // batch
    out: list[Any] = []
    epoch = 0
    while len(out) < steps:
        for s in samplers:
            s.set_epoch(epoch)
        shards = torch.tensor([list(s) for s in samplers])  # [n, samples per worker]
        out += [shards[:, k * batch : (k + 1) * batch] for k in range(per_epoch)]
        epoch += 1
    return out[:steps]


def _bare(job: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    """The same update with ``torch.func`` and no Lightning: every worker's step as one vmapped call."""
    import torch
    from mlp import MLP
    from torch.func import functional_call, grad, vmap

    from lightning_decentral.topology import resolve_topology

    n, total, lr, beta = job["n"], job["warmup"] + job["steps"], job["lr"], job["momentum"]
    batches = _worker_batches(n, job["global_batch"] // n, len(x), total)
    t0 = time.perf_counter()
    wall0 = time.time()
    net = MLP(tuple(job["widths"]), lr, beta).net  # the sim's initial model (seed 0)
    params = {k: v.detach().unsqueeze(0).repeat(n, *[1] * v.dim()) for k, v in net.named_parameters()}
    mixing = torch.tensor(resolve_topology("ring", n).mixing(0), dtype=torch.float32)  # dense W, rows sum to 1

    def loss(p: dict[str, Any], xb: Any, yb: Any) -> Any:
        return torch.nn.functional.cross_entropy(functional_call(net, p, (xb,)), yb)

    gradients = vmap(grad(loss))
    buffers: dict[str, Any] | None = None
    ends = []
    for index in batches:
        g = gradients(params, x[index], y[index])  # [n, ...] per parameter
        if buffers is None:  # torch.optim.SGD: the first momentum buffer is the gradient itself
            buffers = {k: v.clone() for k, v in g.items()}
        else:
            for k in buffers:
                buffers[k].mul_(beta).add_(g[k])
        # AWC: x <- W x_old + (U(x_old) - x_old), with U(x) = x - lr * buffer
        params = {k: torch.einsum("ij,j...->i...", mixing, v).sub_(buffers[k], alpha=lr) for k, v in params.items()}
        ends.append(time.perf_counter())
    if job.get("save"):
        torch.save(params, job["save"])
    return {"ends": [ends], "t0": t0, "wall0": wall0}


def _child(job: dict[str, Any]) -> None:
    """One run, in its own process: print its record as the last line of stdout."""
    harness.use_threads(job["threads"])
    harness.quiet()
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401  (the imports are part of what "imports" measures)
    from mlp import digits

    import lightning_decentral  # noqa: F401

    x, y = digits()
    run = {
        "sim": _lightning,
        "vectorized": _lightning,
        "lightning": _lightning,
        "processes": _processes,
        "bare": _bare,
    }[job["kind"]]
    record = run(job, x, y)
    record["maxrss_mb"] = _maxrss_mb()
    print(json.dumps(record))


# -- the driver ------------------------------------------------------------------------------------------


def _launch(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    launched = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.ROOT), os.environ.get("PYTHONPATH", "")])),
        },
    )
    if done.returncode:
        raise RuntimeError(f"run {job['kind']} n={job['n']} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["imports_s"] = record["wall0"] - launched
    return record


def _steps(record: dict[str, Any], warmup: int) -> list[float]:
    ranks = [{"ends": ends} for ends in record["ends"]]
    return harness.step_times(ranks, warmup)


def _first_step_s(record: dict[str, Any]) -> float:
    return max(ends[0] for ends in record["ends"]) - record["t0"]


def _summarize(name: str, n: int, records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steps = [t for r in records for t in _steps(r, warmup)]
    return {
        "name": name,
        "n": n,
        "median_s": statistics.median(steps),
        "q25_s": harness.quantile(steps, 0.25),
        "q75_s": harness.quantile(steps, 0.75),
        "mean_s": statistics.mean(steps),
        "repeat_medians_s": [statistics.median(_steps(r, warmup)) for r in records],
        "first_step_s": statistics.median(_first_step_s(r) for r in records),
        "imports_s": statistics.median(r["imports_s"] for r in records),
        "maxrss_mb": statistics.median(r["maxrss_mb"] for r in records),
        "rank_maxrss_mb": statistics.median(max(r["rank_maxrss_mb"]) for r in records)
        if "rank_maxrss_mb" in records[0]
        else None,
        "step_times_s": [_steps(r, warmup) for r in records],
    }


LABELS = {
    "sim": "SimulatedDecentralizedStrategy, 1 process",
    "vectorized": "SimulatedDecentralizedStrategy(vectorize=True), 1 process",
    "bare": "bare torch.func loop, 1 process",
    "processes": "DecentralizedStrategy, gloo processes",
    "lightning": "plain Trainer, 1 worker, batch 512 (memory baseline)",
}


def render_table(rows: list[dict[str, Any]], global_batch: int) -> str:
    bare = {r["n"]: r for r in rows if r["name"] == "bare"}
    sim = {r["n"]: r for r in rows if r["name"] == "sim"}
    base = next((r for r in rows if r["name"] == "lightning"), None)
    lines = [
        "| run | n | batch per worker | median step (ms) | IQR (ms) | median of each repeat (ms) | mean step (ms) | "
        "sim / bare (median) | sim / processes (median) | imports (s) | to first step (s) | peak RSS (MB) | MB per "
        "worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["n"]
        vs_bare = f"{r['median_s'] / bare[n]['median_s']:.2f}" if r["name"] in SIMULATIONS and n in bare else ""
        vs_proc = f"{sim[n]['median_s'] / r['median_s']:.2f}" if r["name"] == "processes" and n in sim else ""
        rss = f"{r['maxrss_mb']:.0f}"
        if r["rank_maxrss_mb"] is not None:
            rss = f"{r['maxrss_mb']:.0f} + {n} × {r['rank_maxrss_mb']:.0f}"
        per_worker = ""
        if r["name"] in SIMULATIONS and base is not None:
            per_worker = f"{(r['maxrss_mb'] - base['maxrss_mb']) / n:.2f}"
        repeats = "–".join(f"{1e3 * t:.1f}" for t in (min(r["repeat_medians_s"]), max(r["repeat_medians_s"])))
        lines.append(
            f"| {LABELS[r['name']]} | {n if r['name'] != 'lightning' else 1} | {global_batch // n} | "
            f"{1e3 * r['median_s']:.1f} | {1e3 * r['q25_s']:.1f}–{1e3 * r['q75_s']:.1f} | {repeats} | "
            f"{1e3 * r['mean_s']:.1f} | {vs_bare} | {vs_proc} | {r['imports_s']:.1f} | {r['first_step_s']:.2f} | {rss} "
            f"| {per_worker} |"
        )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers", default=None, help="comma-separated n for sim and bare (default 8,16,64; --smoke: 4)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="gloo processes of DecentralizedStrategy (default 8; --smoke: 4; 0: none)",
    )
    parser.add_argument("--steps", type=int, default=None, help="measured optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped before measuring, >= 1 (default 5)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="every run this many times, in a rotated order (default 3)"
    )
    parser.add_argument("--global-batch", type=int, default=512, help="samples per step over all workers (default 512)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every run's process (default 1)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument(
        "--start-method",
        choices=("fork", "spawn"),
        default=harness.START_METHOD,
        help="how the gloo processes start (default fork, after the imports)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default 900)")
    parser.add_argument("--out", action="append", default=[], help="write results: .md (table) or .json; repeatable")
    parser.add_argument("--smoke", action="store_true", help="n = 4, 1 + 2 steps, a 64-16-10 MLP, 1 repeat")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers = "4" if args.workers is None else args.workers
        args.processes = 4 if args.processes is None else args.processes
        args.steps = 2 if args.steps is None else args.steps
        args.warmup = 1 if args.warmup is None else args.warmup
        args.repeats = 1 if args.repeats is None else args.repeats
    args.workers = [int(n) for n in (args.workers or "8,16,64").split(",")]
    args.processes = 8 if args.processes is None else args.processes
    args.steps = 30 if args.steps is None else args.steps
    args.warmup = 5 if args.warmup is None else args.warmup
    args.repeats = 3 if args.repeats is None else args.repeats
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (a step's time is measured from the end of the previous one)")
    if args.repeats < 1 or any(n < 1 or n > args.global_batch for n in args.workers):
        parser.error("--repeats must be >= 1 and every n in --workers between 1 and --global-batch")
    if args.processes == 1 or args.processes < 0:
        parser.error("--processes must be 0 (none) or >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    harness.exit_on_sigterm()
    widths = SMOKE_WIDTHS if args.smoke else WIDTHS
    common = dict(
        widths=list(widths),
        lr=args.lr,
        momentum=args.momentum,
        global_batch=args.global_batch,
        threads=args.threads,
        warmup=args.warmup,
        steps=args.steps,
        timeout=args.timeout,
        start_method=args.start_method,
    )
    runs = [(kind, n) for kind in (*SIMULATIONS, "bare") for n in args.workers]
    if args.processes:
        runs.append(("processes", args.processes))
    runs.append(("lightning", 1))
    load = os.getloadavg()[0]
    print(
        f"digits (1797 x 64, standardized); MLP {'-'.join(map(str, widths))}: {harness.count_parameters(widths):,} "
        f"parameters; SGD(lr={args.lr}, momentum={args.momentum}); global batch {args.global_batch}; ring, AWC; "
        f"{args.warmup} warm-up + {args.steps} measured steps, {args.repeats} repeat(s); {args.threads} torch "
        f"thread(s) per process; {os.cpu_count()} CPU cores, load average {load:.2f}",
        flush=True,
    )
    started = time.monotonic()
    records: dict[tuple[str, int], list[dict[str, Any]]] = {run: [] for run in runs}
    checks: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="simulate_") as scratch:
        for repeat in range(args.repeats):
            order = runs[repeat % len(runs) :] + runs[: repeat % len(runs)]  # rotate: no run always first
            for kind, n in order:
                job = {**common, "kind": kind, "n": n}
                if repeat == 0 and kind in (*SIMULATIONS, "bare"):
                    job["save"] = str(Path(scratch) / f"{kind}{n}.pt")
                t = time.monotonic()
                record = _launch(job, args.timeout)
                records[(kind, n)].append(record)
                print(
                    f"  repeat {repeat + 1}/{args.repeats}  {kind:<10} n={n:<3} median "
                    f"{1e3 * statistics.median(_steps(record, args.warmup)):8.2f} ms/step  first step "
                    f"{_first_step_s(record):.2f} s  peak RSS {record['maxrss_mb']:.0f} MB  "
                    f"({time.monotonic() - t:.1f} s)",
                    flush=True,
                )
        import torch

        for kind in SIMULATIONS:
            for n in args.workers:
                sim, bare = torch.load(Path(scratch) / f"{kind}{n}.pt"), torch.load(Path(scratch) / f"bare{n}.pt")
                checks[f"{kind} {n}"] = max(float((sim[k] - bare[k]).abs().max()) for k in sim)
                print(
                    f"  n={n}: bare against {kind}, largest |difference| of the final parameters: "
                    f"{checks[f'{kind} {n}']:.2e}",
                    flush=True,
                )
    rows = [_summarize(kind, n, records[(kind, n)], args.warmup) for kind, n in runs]
    table = render_table(rows, args.global_batch)
    elapsed = time.monotonic() - started
    print()
    print(table)
    print(f"\nwhole run: {elapsed:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    import lightning
    import torch

    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": harness.command_line(__file__, argv),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}",
        "load_average_before": load,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "config": {**common, "workers": args.workers, "processes": args.processes, "repeats": args.repeats},
        "elapsed_s": elapsed,
        "bare_vs_sim_max_abs_diff": checks,
    }
    harness.write_outputs(args.out, {"meta": meta, "rows": rows}, table, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
