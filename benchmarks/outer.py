"""Local steps with an outer optimizer (DiLoCo, and gossip with an outer optimizer) against every-step gossip and
the complete graph every step, on a small byte-level language model, in the simulation (one process).

    python benchmarks/outer.py                          # 8 workers, the table of docs/benchmarks.md
    python benchmarks/outer.py --smoke                  # 4 workers, a few steps (the smoke test)
    python benchmarks/outer.py --only complete_every_step,dpsgd_one_peer --out outer.json

The task: next-byte prediction on the Python standard library's own source files (the ``.py`` files directly
in ``sysconfig.get_paths()["stdlib"]``, sorted, read as bytes; nothing is downloaded): the first 90 % train, the
last 10 % validate. The model: a decoder-only transformer (``--width`` 32, ``--layers`` 2, 4 heads, context
``--context`` 64, learned positions, pre-norm blocks, causal attention written out so that ``torch.vmap`` stacks
the workers), inner optimizer ``AdamW(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)``, ``--batch`` 8 sequences
per worker and step. Every run is ``SimulatedDecentralizedStrategy(workers=8)`` for ``--steps`` (160) optimizer steps,
so every run sees the same number of tokens (``8 × 8 × 64`` per step), with ``H = --every`` (20):

* ``complete_every_step``: ``topology="complete", combine="atc"``: the workers' stepped models averaged at every
  step (with SGD this is DDP's trajectory; with AdamW each worker keeps its own moments);
* ``dpsgd_one_peer``: D-PSGD (AWC) on ``one_peer_exponential`` at every step;
* ``diloco``: ``topology="complete", gossip_every=H, outer_optimizer=SGD(lr=0.7, momentum=0.9, nesterov=True)``;
* ``outer_one_peer``: the same outer optimizer over ``one_peer_exponential`` gossip;
* ``outer_one_peer_overlap``: the same with ``outer_overlap=True``;
* ``averaging_one_peer``: ``gossip_every=H`` on ``one_peer_exponential`` without an outer optimizer (ATC), to show
  what the outer optimizer adds;
* ``diloco_sign``, ``outer_one_peer_sign``: ``diloco`` and ``outer_one_peer`` with ``compression="sign"``, the latter
  on the static ``one_peer_ring`` (compression refuses a time-varying graph; one peer a round all the same) (the round's
  models sent as CHOCO's messages, the pseudo-gradient taken from the public copies; the workers run apart, as
  compression needs).

Reported: the validation loss (mean cross-entropy in nats per byte, over ``--val-batches`` batches of the held-out
text) of ``x̄`` after the last step, and the bytes one worker sends per optimizer step, counted by an
``ExchangeObserver`` on the mixer (``strategy.observe``; an all-reduce counts the ring all-reduce's
``2 (n − 1)/n`` of the model, as on processes). The emulated networks of ``benchmarks/netns.py`` (wall-clock on 1
Gbit/s and 100 Mbit/s) are not run here.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_decentral import SimulatedDecentralizedStrategy
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first `limit` bytes of the standard library's top-level `.py` files, sorted by name, as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def sequences(text: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping windows of `context + 1` bytes (input and next-byte target), as int64."""
    count = (len(text) - 1) // (context + 1)
    return text[: count * (context + 1)].view(count, context + 1).long()


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, length, head width]
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(future, float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class ByteGPT(pl.LightningModule):
    """A small decoder-only language model over bytes."""

    def __init__(self, context: int = 64, width: int = 64, layers: int = 2, heads: int = 4, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(0.02 * torch.randn(context, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)

    def loss(self, batch: Any) -> torch.Tensor:
        (window,) = batch
        inputs, targets = window[:, :-1], window[:, 1:]
        hidden = self.blocks(self.embed(inputs) + self.position[: inputs.shape[1]])
        logits = self.head(self.norm(hidden))
        return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.01)


class Bytes(ExchangeObserver):
    """Bytes sent, all workers together."""

    def __init__(self) -> None:
        self.sent = 0

    def on_post(self, event: ExchangeEvent) -> None:
        self.sent += event.bytes_sent


NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def methods(every: int) -> dict[str, dict[str, Any]]:
    """The strategies compared, by name (see the module docstring)."""
    one_peer = {"topology": "one_peer_exponential"}
    return {
        "complete_every_step": {"topology": "complete", "combine": "atc"},
        "dpsgd_one_peer": one_peer,
        "diloco": {"topology": "complete", "gossip_every": every, "outer_optimizer": NESTEROV},
        "outer_one_peer": {**one_peer, "gossip_every": every, "outer_optimizer": NESTEROV},
        "outer_one_peer_overlap": {
            **one_peer,
            "gossip_every": every,
            "outer_optimizer": NESTEROV,
            "outer_overlap": True,
        },
        "averaging_one_peer": {**one_peer, "combine": "atc", "gossip_every": every},
        "diloco_sign": {
            "topology": "complete",
            "gossip_every": every,
            "outer_optimizer": NESTEROV,
            "compression": "sign",
        },
        "outer_one_peer_sign": {  # compression refuses a time-varying graph: one peer a round on a static ring
            "topology": "one_peer_ring",
            "gossip_every": every,
            "outer_optimizer": NESTEROV,
            "compression": "sign",
        },
    }


def run(
    name: str, options: dict[str, Any], args: argparse.Namespace, train: torch.Tensor, val: torch.Tensor
) -> dict[str, Any]:
    """One method: train, validate `x̄`, count the bytes."""
    pl.seed_everything(0, verbose=False)
    model = ByteGPT(args.context, args.width, args.layers)
    strategy = SimulatedDecentralizedStrategy(workers=args.workers, **options)
    counter = Bytes()
    strategy.observe(counter)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=args.val_batches,
    )
    started = time.perf_counter()
    trainer.fit(model, DataLoader(TensorDataset(train), batch_size=args.batch, shuffle=True, drop_last=True))
    seconds = time.perf_counter() - started
    (metrics,) = trainer.validate(model, DataLoader(TensorDataset(val), batch_size=64), verbose=False)
    return {
        "method": name,
        "val_loss": metrics["val_loss"],
        "bytes_per_step": counter.sent / (args.workers * args.steps),
        "tokens": args.steps * args.workers * args.batch * args.context,
        "seconds": seconds,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of `rows`, with each method's loss and bytes relative to the first row's."""
    base = rows[0]
    lines = [
        "| method | val loss (nats/byte) | vs first | bytes/step/worker | vs first | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["bytes_per_step"] / base["bytes_per_step"] if base["bytes_per_step"] else float("nan")
        lines.append(
            f"| {r['method']} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / base['val_loss'] - 1):+.2f} % | "
            f"{r['bytes_per_step']:,.0f} | {ratio:.3f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, default=20, help="H, the inner steps of a round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=3_000_000, help="how much of the standard library to read")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated methods (default: all)")
    parser.add_argument("--smoke", action="store_true", help="4 workers, 6 steps, H = 3, a tiny model")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.steps, args.every, args.batch, args.width, args.bytes, args.val_batches = (
            4,
            6,
            3,
            4,
            16,
            200_000,
            1,
        )
    torch.set_num_threads(args.threads)
    windows = sequences(stdlib_bytes(args.bytes), args.context)
    split = int(0.9 * len(windows))
    train, val = windows[:split], windows[split:]
    chosen = methods(args.every)
    names = [n for n in args.only.split(",") if n] or list(chosen)
    rows = [run(name, chosen[name], args, train, val) for name in names]
    print(table(rows))
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k not in ("out", "only")}
        meta.update(train_windows=len(train), val_windows=len(val), torch=torch.__version__)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
