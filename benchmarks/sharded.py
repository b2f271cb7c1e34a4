"""Issue 37's benchmark: sharded replicas (FSDP2 inside a host, gossip between hosts) against Lightning's HSDP on the
emulated network of ``netns.py``: 4 hosts of 2 ranks, the ranks of a host on its own fast path, hosts joined by
shaped links. Root on Linux.

    python benchmarks/sharded.py                                   # profiles 100mbit and 1gbit, 500 steps, H = 50
    python benchmarks/sharded.py --smoke                           # 100mbit, a few steps, a tiny model
    python benchmarks/sharded.py --profiles 100mbit --steps 100 --every 20 --extend sharded_diloco=2 --out t.json

The model is a byte-level language model with ``outer.py``'s blocks (``--width``, ``--layers``: a few million
parameters), its data the standard library's own source as bytes, AdamW inside every method. Each block and the model's
root are sharded with FSDP2 over a host's 2 ranks in ``configure_model``. The methods (``METHODS``):

* ``hsdp``: Lightning's ``ModelParallelStrategy`` with FSDP2 on a 2-D mesh ``(replicate, shard)``: HSDP, the gradients
  reduce-scattered in a host and all-reduced between hosts every step;
* ``sharded_no_exchange``: the floor, ``DecentralizedStrategy(shard_size=2, topology="ring")`` with a ``gossip_every``
  longer than the run: FSDP2's all-gathers and reduce-scatters in a host, nothing sent between hosts (as
  ``netns.py``'s ``no_exchange``): no method that reaches across hosts can step faster;
* ``sharded_one_peer``: ``DecentralizedStrategy(shard_size=2, topology="one_peer_exponential")``, AWC every step;
* ``sharded_ring_sign``: ``compression="sign"`` on the undirected ``ring`` (two peers a step, 1/32 of the bytes each):
  compression refuses a time-varying graph, and on the directed ``one_peer_ring`` it diverged on this model;
* ``sharded_diloco``: ``shard_size=2, topology="complete", gossip_every=H`` with DiLoCo's outer Nesterov step
  (``--outer``: its learning rate and momentum, DiLoCo's 0.7 and 0.9 unless given).

Every method trains ``--steps`` steps, those named in ``--extend`` (``method=factor``) that many times as many, to see
when they reach HSDP's loss at step ``--steps``. Measured per rank: the bytes of its parameters and optimizer state
(its local shards), the median time of a training step after ``--warmup``, and every ``H`` steps the validation loss
(of ``x̄`` for the decentralized methods; mean cross-entropy in nats per byte over ``--val-windows`` held-out windows)
against the training time so far (validation's own time left out). Every ratio is against ``hsdp`` and the floor in the
same run (each method in 8 fresh processes, one after another, on the same network).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import harness
import lightning.pytorch as pl
import outer
import torch
from torch import nn

METHODS = ("hsdp", "sharded_no_exchange", "sharded_one_peer", "sharded_ring_sign", "sharded_diloco")
FLOOR = "sharded_no_exchange"
SHARD = 2  # ranks per host: one replica per host
GOALS = (
    "per-rank params + optimizer state <= 1.1/s of unsharded; 100 Mbit/s: sharded one-peer + sign step <= 0.3x HSDP's; "
    "sharded DiLoCo reaches HSDP's loss at the last step sooner"
)


class GPT(nn.Module):
    """``outer.ByteGPT``'s network as a module of its own, so that FSDP2 can shard its root (its forward runs)."""

    def __init__(self, context: int, width: int, layers: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(0.02 * torch.randn(context, width))
        self.blocks = nn.ModuleList([outer.Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(inputs) + self.position[: inputs.shape[1]]
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class ShardedLM(pl.LightningModule):
    """The language model, sharded in ``configure_model`` on ``mesh()`` (the strategy's device mesh by default)."""

    def __init__(self, context: int, width: int, layers: int, hsdp: bool) -> None:
        super().__init__()
        self.net = GPT(context, width, layers)
        self.hsdp = hsdp

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):
            return
        if self.hsdp:  # replicate across hosts, shard in a host: FSDP2's HSDP
            world = torch.distributed.get_world_size()
            mesh = init_device_mesh("cpu", (world // SHARD, SHARD), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = self.device_mesh["shard"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def loss(self, batch: Any) -> torch.Tensor:
        (window,) = batch
        logits = self.net(window[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)


def method_steps(method: str, config: dict[str, Any]) -> int:
    """``--steps``, times the method's ``--extend`` factor (1 if it has none)."""
    return round(config["extend"].get(method, 1.0) * config["steps"])


def outer_optimizer(config: dict[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    """DiLoCo's outer step: Nesterov SGD at ``--outer``'s learning rate and momentum (plain SGD at momentum 0)."""
    lr, momentum = config["outer"]
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)


def make_strategy(method: str, config: dict[str, Any], world_size: int, steps: int) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_decentral import DecentralizedStrategy

    options = {
        "sharded_one_peer": dict(topology="one_peer_exponential"),
        "sharded_ring_sign": dict(topology="ring", compression="sign"),  # symmetric: sign diverged on one_peer_ring
        "sharded_diloco": dict(
            topology="complete", gossip_every=config["every"], outer_optimizer=outer_optimizer(config)
        ),
    }
    if method == "hsdp":
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    if method == FLOOR:  # (k + 1) % gossip_every is never 0 in the run: every step local, nothing sent between hosts
        return DecentralizedStrategy(shard_size=SHARD, topology="ring", gossip_every=steps + 1)
    return DecentralizedStrategy(shard_size=SHARD, **options[method])


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of this rank's parameters and optimizer state (the local shards of sharded ones)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = list(module.parameters()) + [
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    return sum(local(t).numel() * t.element_size() for t in tensors)


class Clock(pl.Callback):
    """Training time (validation's left out), each step's time, and the validation loss every ``every`` steps."""

    def __init__(self) -> None:
        self.training, self.steps, self.points, self.held = 0.0, [], [], 0
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        took = time.perf_counter() - self._started
        self.training += took
        self.steps.append(took)
        if not self.held:
            self.held = held_bytes(module, trainer.optimizers[0])

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        loss = float(trainer.callback_metrics["val_loss"])
        self.points.append({"step": trainer.global_step, "seconds": self.training, "loss": loss})


def _job(method: str, config: dict[str, Any], data: dict[str, Any], world_size: int) -> dict[str, Any]:
    from mlp import quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    pl.seed_everything(0, verbose=False)
    model = ShardedLM(config["context"], config["width"], config["layers"], hsdp=method == "hsdp")
    clock = Clock()
    steps = method_steps(method, config)
    trainer = quiet_trainer(
        make_strategy(method, config, world_size, steps),
        steps,
        [clock],
        num_nodes=world_size // SHARD,
        devices=SHARD,
        num_sanity_val_steps=0,
        val_check_interval=config["every"],
        check_val_every_n_epoch=None,
    )
    train = DataLoader(TensorDataset(data["train"]), batch_size=config["batch"], shuffle=True, drop_last=True)
    val = DataLoader(TensorDataset(data["val"]), batch_size=config["batch"])
    trainer.fit(model, train, val)
    timed = clock.steps[config["warmup"] :] or clock.steps
    return {"held": clock.held, "step_median": statistics.median(timed), "points": clock.points}


Job = Callable[[dict[str, Any], dict[str, Any], int, int], dict[str, Any]]


def work(spec: dict[str, Any], data: dict[str, Any], rank: int, jobs: dict[str, Job] | None = None) -> list[dict]:
    """One rank: every method in order, alternating as the spec lists them; ``jobs`` runs methods from outside this
    file (``jobs[m](spec, data, rank, world_size)`` returns what ``_job`` does)."""
    harness.use_threads(spec["config"]["threads"])
    harness.quiet()
    world_size = int(os.environ["WORLD_SIZE"])
    jobs = jobs or {}
    return [
        {
            "method": m,
            **(jobs[m](spec, data, rank, world_size) if m in jobs else _job(m, spec["config"], data, world_size)),
        }
        for m in spec["methods"]
    ]


def summarize(per_rank: list[list[dict[str, Any]]], unsharded_bytes: int, steps: int) -> list[dict[str, Any]]:
    """Per method: the most any rank holds, the slowest rank's median step, the curve (loss of rank 0: every rank
    logs the same synchronized value; the slowest rank's time), each against ``hsdp``'s and the floor's; the loss at
    step ``steps`` (the same tokens for every method) and when HSDP's loss there is first reached."""
    rows = []
    for i, first in enumerate(per_rank[0]):
        runs = [r[i] for r in per_rank]
        rows.append(
            {
                "method": first["method"],
                "held_bytes": max(r["held"] for r in runs),
                "held_vs_unsharded": max(r["held"] for r in runs) / unsharded_bytes,
                "step_seconds": max(r["step_median"] for r in runs),
                "points": [
                    {**p, "seconds": max(r["points"][k]["seconds"] for r in runs)}
                    for k, p in enumerate(first["points"])
                ],
            }
        )
    base = next(r for r in rows if r["method"] == "hsdp")
    floor = next((r for r in rows if r["method"] == FLOOR), None)
    target = next((p["loss"] for p in base["points"] if p["step"] == steps), None)
    for row in rows:
        row["step_vs_hsdp"] = row["step_seconds"] / base["step_seconds"]
        row["step_vs_floor"] = None if floor is None else row["step_seconds"] / floor["step_seconds"]
        row["loss_at_steps"] = next((p["loss"] for p in row["points"] if p["step"] == steps), None)
        reached = [p for p in row["points"] if target is not None and p["loss"] <= target]
        row["to_hsdp_loss"] = {"seconds": reached[0]["seconds"], "step": reached[0]["step"]} if reached else None
        row["steps_run"] = row["points"][-1]["step"] if row["points"] else 0
    return rows


def render(profile: str, rows: list[dict[str, Any]], config: dict[str, Any], command: str, load: str) -> str:
    def fixed(value: float | None, digits: int) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    steps = config["steps"]
    lines = [
        f"Profile {profile}; {config['parameters']:,} parameters; {steps} steps (times {config['extend']}), "
        f"H = {config['every']}; load: {load}. Command: `{command}`",
        "",
        "| method | params + optimizer state per rank (MB) | vs unsharded | step (s, median) | vs HSDP | vs floor "
        f"| val loss at {steps} | time to HSDP's loss at {steps} (s, step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        reached = row["to_hsdp_loss"]
        lines.append(
            f"| {row['method']} | {row['held_bytes'] / 1e6:.2f} | {row['held_vs_unsharded']:.3f} | "
            f"{row['step_seconds']:.3f} | {row['step_vs_hsdp']:.2f} | {fixed(row['step_vs_floor'], 2)} | "
            f"{fixed(row['loss_at_steps'], 3)} | "
            + (
                f"not in {row['steps_run']} steps"
                if reached is None
                else f"{reached['seconds']:.1f} ({reached['step']})"
            )
            + " |"
        )
    curve_steps = sorted({p["step"] for row in rows for p in row["points"]})
    lines += [
        "",
        "| step | " + " | ".join(row["method"] for row in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for step in curve_steps:
        cells = []
        for row in rows:
            point = next((p for p in row["points"] if p["step"] == step), None)
            cells.append("" if point is None else f"{point['loss']:.3f} @ {point['seconds']:.0f} s")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None, methods: tuple[str, ...] = METHODS, doc: str | None = __doc__) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="100mbit,1gbit")
    parser.add_argument("--methods", default=",".join(methods))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=50, help="H: DiLoCo's round, and how often the loss is measured")
    parser.add_argument(
        "--extend",
        default="",
        help="comma-separated method=factor: those methods train factor times --steps (to reach HSDP's loss there)",
    )
    parser.add_argument("--outer", default="0.7,0.9", help="DiLoCo's outer learning rate and momentum: lr,momentum")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--val-windows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        args.extend = {m: float(f) for m, f in (pair.split("=") for pair in args.extend.split(",") if pair)}
    except ValueError:
        parser.error(f"--extend takes method=factor pairs, such as sharded_diloco=1.6, not {args.extend!r}")
    try:
        lr, momentum = (float(x) for x in args.outer.split(","))
    except ValueError:
        parser.error(f"--outer takes lr,momentum, such as 0.7,0.9, not {args.outer!r}")
    args.outer = (lr, momentum)
    unknown = [m for m in [*args.methods.split(","), *args.extend] if m not in methods]
    if unknown or "hsdp" not in args.methods.split(","):
        parser.error(f"unknown methods {unknown} (choose from {', '.join(methods)}; hsdp is every ratio's base)")
    if args.smoke:
        args.profiles, args.steps, args.every, args.warmup, args.width, args.layers = "100mbit", 6, 3, 1, 32, 1
    return args


def main(
    argv: list[str] | None = None, jobs: dict[str, Job] | None = None, script: str = __file__, doc: str | None = __doc__
) -> int:
    """Every profile: each method (``METHODS`` and ``jobs``' own) in 8 fresh processes on the same emulated network, one
    after another (a method that fails, say diverges, is reported and the others still run), a table, the results."""
    jobs = jobs or {}
    args = parse(argv, METHODS + tuple(jobs), doc)
    permitted, why = harness.netns_permitted()
    if not permitted:
        print(f"needs network namespaces (root on Linux): {why}", file=sys.stderr)
        return 2
    text = outer.stdlib_bytes(2_000_000)
    windows = outer.sequences(text, args.context)
    data = {"train": windows[args.val_windows :], "val": windows[: args.val_windows]}
    model = GPT(args.context, args.width, args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    unsharded_bytes = 3 * parameters * 4  # float32 parameters and AdamW's two moments
    config = {**vars(args), "parameters": parameters, "threads": args.threads}
    command = harness.command_line(f"benchmarks/{os.path.basename(script)}", argv)
    tables, results = [], []
    for name in args.profiles.split(","):
        before = open("/proc/loadavg").read().strip()
        per_rank: list[list[dict[str, Any]]] = [[] for _ in range(4 * SHARD)]
        failed = {}
        with harness.EmulatedNetwork(4, harness.PROFILES[name]) as network:
            for method in args.methods.split(","):
                spec = {"config": config, "methods": [method], "addresses": network.addresses}
                try:
                    ranks = harness.run_ranks(
                        functools.partial(work, spec, data, jobs=jobs),
                        4 * SHARD,
                        timeout=args.timeout,
                        network=network,
                        ranks_per_host=SHARD,
                    )
                except RuntimeError as error:
                    failed[method] = str(error).strip().splitlines()[-1]
                    print(f"{name}, {method} failed: {failed[method]}", file=sys.stderr, flush=True)
                    continue
                for mine, (result,) in zip(per_rank, ranks):
                    mine.append(result)
        load = f"{before} before, {open('/proc/loadavg').read().strip()} after"
        rows = summarize(per_rank, unsharded_bytes, args.steps)
        results.append({"profile": name, "load": load, "rows": rows, "failed": failed, "shaping": network.shaping})
        tables.append(
            render(name, rows, config, command, load) + "".join(f"\n\n{m} failed: {e}" for m, e in failed.items())
        )
        print(tables[-1], flush=True)  # and written after every profile: a later one may run past the budget
        harness.write_outputs(args.out, {"goals": GOALS, "config": config, "profiles": results}, "\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
