"""A tiny GPT trained with DecentLaM in a hand-written Lightning Fabric loop (LitGPT style), offline.

Run from the repository root::

    python examples/fabric_gpt.py                          # 4 CPU workers, DecentLaM on a ring
    python examples/fabric_gpt.py --steps 300 --resume     # continue from out/fabric_gpt/last.ckpt

The text is generated (sentences of a small grammar), the model is a character-level decoder-only
Transformer. Every worker trains its own replica on its shard of the text (the distributed sampler
of `fabric.setup_dataloaders`); validation runs on the averaged model `x̄`; the checkpoint holds
`x̄` (loadable by `torch.load` into the plain module) and one shard per worker for an exact resume.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_decentral  # noqa: F401  (registers strategy="decentlam" in Fabric)
from lightning_decentral.fabric import DataOrder, consensus_metrics

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "every bird", "the teacher"]
VERBS = ["sees", "likes", "follows", "finds", "paints", "calls"]
OBJECTS = ["the moon", "a red ball", "the river", "some bread", "the garden", "a small boat"]
ENDINGS = ["today", "at night", "again", "in the rain", "with joy", "slowly"]


def generate_text(sentences: int, seed: int = 0) -> str:
    """Sentences of a small grammar: the same text on every worker (seeded)."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."
        for _ in range(sentences)
    )


class CharDataset(Dataset):
    """Windows of `block_size + 1` characters: input and next-character target."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[index * self.block_size : (index + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention, then an MLP."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm_1, self.norm_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm_1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attention)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    """A decoder-only character model: token and position embeddings, `n_layer` blocks, a tied head."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(self.tokens(idx) + self.positions(positions))))


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def validate(fabric: Fabric, model: nn.Module, loader: DataLoader) -> float:
    """The mean validation loss over every worker's batches (of the model swapped in)."""
    model.eval()
    losses = torch.stack([loss_of(model, batch) for batch in loader])
    model.train()
    return float(fabric.all_reduce(losses.mean(), reduce_op="mean"))


def main(args: argparse.Namespace) -> dict[str, float]:
    """Train (or resume) to `args.steps` optimizer steps and save; the steps resumed from and the last val loss."""
    fabric = Fabric(
        strategy="decentlam", accelerator="cpu", devices=args.devices, loggers=CSVLogger(args.out_dir, name="logs")
    )
    fabric.launch()
    fabric.seed_everything(1234 + fabric.global_rank)  # a different init per worker: rank 0's is broadcast

    text = generate_text(args.sentences)
    vocabulary = sorted(set(text))
    tokens = torch.tensor([vocabulary.index(c) for c in text])
    split = int(0.9 * len(tokens))
    train = DataLoader(CharDataset(tokens[:split], args.block_size), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(CharDataset(tokens[split:], args.block_size), batch_size=args.batch_size)
    train, val = fabric.setup_dataloaders(train, val)  # each worker gets its shard

    model = GPT(len(vocabulary), args.block_size, args.n_layer, args.n_head, args.n_embd)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # DecentLaM: momentum SGD
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "data": DataOrder(train), "iter_num": 0}  # data: the epoch
    checkpoint, resumed_from, val_loss = Path(args.out_dir) / "last.ckpt", 0, math.nan
    if args.resume and checkpoint.exists():
        fabric.load(checkpoint, state)  # every replica continues exactly (same number of workers)
        resumed_from = fabric.strategy.step
        fabric.print(f"Resumed from {checkpoint} at step {resumed_from}")

    strategy = fabric.strategy
    iterator = iter(train)  # Fabric sets the sampler's epoch at each iter(train): the epochs begun, restored by load
    while strategy.step < args.steps:
        for micro in range(args.accumulate):
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = iter(train)
                batch = next(iterator)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                fabric.backward(loss_of(model, batch) / args.accumulate)
        warmup = min(1.0, (strategy.step + 1) / args.warmup)
        for group in optimizer.param_groups:  # linear warm-up, then cosine decay
            group["lr"] = args.lr * warmup * 0.5 * (1 + math.cos(math.pi * strategy.step / args.steps))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["iter_num"] = strategy.step
        if strategy.step % args.eval_every == 0 or strategy.step == args.steps:
            with strategy.evaluation():  # x̄ in every worker's module; each replica restored after
                val_loss = validate(fabric, model, val)
            metrics = {"val_loss": val_loss, **consensus_metrics(strategy)}
            fabric.log_dict(metrics, step=strategy.step)
            fabric.print(
                f"step {strategy.step}: val loss of x̄ {val_loss:.3f}, consensus distance "
                f"{float(metrics['consensus/distance']):.2e}"
            )
    fabric.save(checkpoint, state)
    fabric.print(f"Saved {checkpoint} (x̄ and {fabric.world_size} shards) at step {strategy.step}")
    fabric.logger.finalize("success")  # writes the CSV
    strategy.teardown()
    return {"resumed_from": resumed_from, "step": strategy.step, "val_loss": val_loss}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out_dir", default="out/fabric_gpt")
    parser.add_argument("--sentences", type=int, default=4000)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval_every", type=int, default=50)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
