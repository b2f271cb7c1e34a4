"""The dense single-process reference of docs/algorithms.md (§1, §2 and §4, bounded staleness, compressed gossip).

All ``n`` replicas live in one process; ``W(k)`` is written here from the closed forms
of §5, independently of ``lightning_decentral.topology``, and applied as a dense matrix.
Under bounded staleness every replica's history is kept, and worker ``i`` takes its
neighbour ``j``'s row of step ``τ_ij(k) = max(k − d, k₀)``, ``d = delays(i, j, k, s)``.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_decentral.compression import RandomK, resolve_compression
from tests.choco_reference import ChocoReference
from tests.models import init_seed, initial_net, make_optimizer, make_scheduler, rank_data


def mixing(name: str, n: int, step: int) -> torch.Tensor:
    """``W(step)`` for ``n`` ranks, float64."""
    eye = torch.eye(n, dtype=torch.float64)
    if n == 1:
        return eye
    shift = lambda offset: torch.roll(eye, shifts=offset, dims=1)  # noqa: E731  row i has its 1 at i + offset
    if name == "complete":
        return torch.full((n, n), 1.0 / n, dtype=torch.float64)
    if name == "ring":
        return (eye + shift(1)) / 2 if n == 2 else (eye + shift(1) + shift(-1)) / 3
    if name == "exponential":
        offsets = [2**m for m in range(n) if 2**m < n]
        return (eye + sum(shift(o) for o in offsets)) / (2 + math.floor(math.log2(n - 1)))
    if name == "one_peer_exponential":
        tau = math.ceil(math.log2(n))
        return (eye + shift(2 ** (step % tau))) / 2
    if name == "random_matching":  # seed 0, period 64: pairs of numpy's permutation from (0, k mod 64), halves
        order = np.random.default_rng([0, step % 64]).permutation(n).tolist()
        w = eye.clone()
        for a, b in zip(order[0::2], order[1::2]):
            w[a, a] = w[b, b] = w[a, b] = w[b, a] = 0.5
        return w
    raise ValueError(name)


def _part(spec: Any, n: int, step: int) -> torch.Tensor:
    return mixing(spec, n, step) if isinstance(spec, str) else torch.tensor(spec, dtype=torch.float64)


def _is_average(w: torch.Tensor) -> bool:
    return bool(torch.allclose(w, torch.full_like(w, 1.0 / w.shape[0]), atol=1e-12, rtol=0))


def stages(config: Config, n: int, step: int) -> list[tuple[torch.Tensor, bool]]:
    """The exchanges of one gossip round at ``step``, applied in order, each with whether it is an
    exact average over its group: ``[W(step)]``, or for ``hierarchical`` (``m`` ranks per node,
    rank ``a m + l``) ``[I_N ⊗ W_in, W_out ⊗ I_m]``, whose product is ``W_out ⊗ W_in``."""
    if config.topology != "hierarchical":
        w = mixing(config.topology, n, config.phase(step))
        return [(w, _is_average(w))]
    inner, outer, m = config.hierarchy
    m = m or n // config.num_nodes
    w_in, w_out = _part(inner, m, step), _part(outer, n // m, step)
    if _is_average(torch.kron(w_out, w_in)):
        return [(torch.full((n, n), 1.0 / n, dtype=torch.float64), True)]
    eye = lambda size: torch.eye(size, dtype=torch.float64)  # noqa: E731
    return [(torch.kron(eye(n // m), w_in), _is_average(w_in)), (torch.kron(w_out, eye(m)), _is_average(w_out))]


def gossip(x: torch.Tensor, config: Config, step: int, rounds: int) -> torch.Tensor:
    """``rounds`` gossip rounds on the rows of ``x`` (one row per rank).

    Full precision: ``x <- W x``. With ``config.gossip_dtype``, the low-precision rule
    ``x <- x + W q − q``, ``q = x`` rounded to that dtype (from float32), for every exchange
    except exact averages over a group (all-reduces), which stay in full precision.
    """
    for _ in range(rounds):
        for w, average in stages(config, x.shape[0], step):
            if config.gossip_dtype is None or average:
                x = w @ x
            else:
                q = x.to(torch.float32).to(config.gossip_dtype).double()
                x = x + w @ q - q
    return x


@dataclass
class Config:
    """One training run: what both the strategy and the reference are given."""

    name: str
    topology: str = "ring"
    combine: str = "awc"
    momentum: str = "local"
    optimizer: dict[str, Any] = field(default_factory=lambda: {"lr": 0.1})
    gossip_every: int = 1
    gossip_steps: Any = 1  # an int, or {"step": {first step: rounds}} / {"epoch": {first epoch: rounds}}
    steps_per_epoch: int | None = None  # with gossip_steps by epoch: step k is in epoch k // steps_per_epoch
    steps: int = 6
    batch_size: int = 8
    accumulate: int = 1
    clip: float | None = None
    scheduler: str | None = None
    dtype: torch.dtype = torch.float32
    batch_norm: bool = False
    bucket_cap_mb: float = 4.0
    gossip_dtype: torch.dtype | None = None
    hierarchy: tuple | None = None  # topology="hierarchical": (inner, outer, ranks_per_node); a part may be a matrix
    num_nodes: int = 1  # nodes emulated through Lightning's layout (NODE_RANK, LOCAL_RANK)
    staleness: int = 0
    delays: Callable[[int, int, int, int], int] | None = None  # (worker, neighbour, step, staleness) -> d
    restarts: tuple[int, ...] = ()  # steps a run resumed at: a neighbour's earlier steps are not used after them
    epoch_steps: int | None = None  # the data of this many steps, again every epoch (None: new data every step)
    failures: dict = field(default_factory=dict)  # {step: [ranks]}: they die there; the step is local for the others
    outer: dict[str, Any] | None = None  # an outer step every gossip_every steps: torch.optim.SGD's arguments
    outer_overlap: bool = False
    compression: Any = None  # compressed gossip (CHOCO): a name or a Compressor
    consensus_step: float | None = None  # its γ (None: the compressor's default)
    compression_overlap: bool = False  # its exchanges on the mixer's helper thread (processes)

    @property
    def samples(self) -> int:
        return (self.epoch_steps or self.steps) * self.accumulate * self.batch_size

    def optimizer_spec(self) -> dict[str, Any]:
        """The keyword arguments of ``tests.models.Regression`` that choose the optimizer."""
        return {**self.optimizer, "scheduler": self.scheduler}

    def outer_optimizer(self) -> Callable[..., torch.optim.Optimizer]:
        """``outer`` as the strategies take it: ``functools.partial(torch.optim.SGD, **outer)``."""
        return functools.partial(torch.optim.SGD, **self.outer)

    def phase(self, step: int) -> int:
        """The matrix of a time-varying topology that step ``step`` applies: one per gossip round,
        ``⌊step / gossip_every⌋`` (a hierarchical topology's parts: by the step)."""
        return step if self.topology == "hierarchical" else step // self.gossip_every

    def strategy_kwargs(self) -> dict[str, Any]:
        from lightning_decentral import Hierarchical

        extra: dict[str, Any] = {} if self.gossip_dtype is None else {"gossip_dtype": self.gossip_dtype}
        if self.staleness:
            extra.update(staleness=self.staleness, delays=self.delays)
        if self.outer is not None:
            extra.update(outer_optimizer=self.outer_optimizer(), outer_overlap=self.outer_overlap)
        if self.compression is not None:
            extra.update(
                compression=self.compression,
                consensus_step=self.consensus_step,
                compression_overlap=self.compression_overlap,
            )
        return {
            **extra,
            "topology": Hierarchical(*self.hierarchy) if self.topology == "hierarchical" else self.topology,
            "combine": self.combine,
            "momentum": self.momentum,
            "gossip_every": self.gossip_every,
            "gossip_steps": self.gossip_steps,
            "bucket_cap_mb": self.bucket_cap_mb,
        }


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _flat_buffers(module: nn.Module) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in module.buffers() if b.is_floating_point()] or [torch.zeros(0)])


def _assign_buffers(module: nn.Module, vector: torch.Tensor) -> None:
    offset = 0
    for b in (b for b in module.buffers() if b.is_floating_point()):
        b.copy_(vector[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


def _assign(module: nn.Module, vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def run(config: Config, n: int) -> torch.Tensor:
    """Every replica's parameters (then its floating buffers) after ``config.steps`` steps, ``n × d``.

    Buffers are mixed with the same ``W``: AWC ``b(k+1) = W b(k) + (b_forward − b(k))``, the other
    rules ``b(k+1) = W b_forward``. ``config.failures``: at step ``k`` the ranks listed die, step ``k`` is a local
    step for the others, and from ``k + 1`` they mix with the named topology at their number (rows: the survivors).
    """
    start = initial_net(init_seed(0), config.batch_norm).to(config.dtype)  # rank 0's initial weights
    replicas = [copy.deepcopy(start) for _ in range(n)]
    optimizers = [make_optimizer(r.parameters(), **config.optimizer) for r in replicas]
    schedulers = [make_scheduler(o, config.scheduler) for o in optimizers]
    data = [rank_data(i, config.samples, config.dtype) for i in range(n)]
    history = StaleHistory(config, n)
    choco = None
    if config.compression is not None:
        # a compressor that draws at random starts its copies at the models (docs/algorithms.md, "Compressed gossip")
        origins = {0: _flat(start).double(), 1: _flat_buffers(start).double()}
        random = isinstance(resolve_compression(config.compression), RandomK)
        choco = ChocoReference(
            config.compression,
            config.consensus_step,
            lambda step: mixing(config.topology, n, config.phase(step)),
            origins=origins if random else None,
        )
    alive = list(range(n))
    for k in range(config.steps):
        lost = config.failures.get(k, [])
        if lost:
            keep = [i for i, rank in enumerate(alive) if rank not in lost]
            replicas, optimizers, schedulers, alive = (
                [v[i] for i in keep] for v in (replicas, optimizers, schedulers, alive)
            )
        buffers_before = torch.stack([_flat_buffers(r) for r in replicas]).double()
        for i, (replica, optimizer) in enumerate(zip(replicas, optimizers)):
            optimizer.zero_grad()
            for a in range(config.accumulate):
                b = (k % config.epoch_steps if config.epoch_steps else k) * config.accumulate + a
                rows = slice(b * config.batch_size, (b + 1) * config.batch_size)
                x, y = data[alive[i]][0][rows], data[alive[i]][1][rows]
                (nn.functional.mse_loss(replica(x), y) / config.accumulate).backward()
            if config.clip is not None:
                nn.utils.clip_grad_norm_(replica.parameters(), config.clip)
        before = torch.stack([_flat(r) for r in replicas]).double()
        rounds = scheduled_rounds(config, k) if (k + 1) % config.gossip_every == 0 and not lost else 0

        def mix(x: torch.Tensor, key: str = "x", *, k: int = k, rounds: int = rounds) -> torch.Tensor:
            if choco is not None:  # the flat parameters are buffer 0 of the exchange, the flat buffers buffer 1
                return choco.mix(x, k, rounds, key=0 if key == "x" else 1) if rounds else x
            return history.mix(x, k, key) if config.staleness else gossip(x, config, k, rounds)

        if config.momentum == "decentlam":
            _decentlam_gradients(replicas, optimizers, mix)
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        stepped = torch.stack([_flat(r) for r in replicas]).double()
        if config.momentum == "decentlam":
            new = stepped
        elif config.combine == "awc":
            new = mix(before) + stepped - before
        else:
            new = mix(stepped)
        buffers_after = torch.stack([_flat_buffers(r) for r in replicas]).double()
        if config.momentum == "local" and config.combine == "awc":
            new_buffers = mix(buffers_before, "b") + buffers_after - buffers_before
        else:
            new_buffers = mix(buffers_after, "b")
        for replica, vector, buffers in zip(replicas, new, new_buffers):
            _assign(replica, vector.to(config.dtype))
            _assign_buffers(replica, buffers.to(config.dtype))
    return torch.stack([torch.cat([_flat(r), _flat_buffers(r)]) for r in replicas])


class StaleHistory:
    """Every row each worker sent, by buffer and step; ``mix`` is one round of ``W(k)`` in which worker ``i`` takes
    neighbour ``j``'s row of step ``τ_ij(k) = max(k − d, k₀)`` (``k₀``: the last restart, else 0)."""

    def __init__(self, config: Config, n: int) -> None:
        self.config, self.n = config, n
        self.sent: dict[str, dict[int, torch.Tensor]] = {}

    def mix(self, x: torch.Tensor, k: int, key: str) -> torch.Tensor:
        config = self.config
        self.sent.setdefault(key, {})[k] = x
        first = max([r for r in config.restarts if r <= k], default=0)
        w = mixing(config.topology, self.n, k)
        out = torch.diagonal(w)[:, None] * x
        for i in range(self.n):
            for j in range(self.n):
                if j != i and w[i, j] != 0:
                    d = config.delays(i, j, k, config.staleness) if config.delays is not None else 0
                    assert 0 <= d <= config.staleness
                    out[i] += w[i, j] * self.sent[key][max(k - d, first)][j]
        return out


def scheduled_rounds(config: Config, k: int) -> int:
    """The rounds ``config.gossip_steps`` gives a gossip step ``k``: the entry of the last milestone reached."""
    if isinstance(config.gossip_steps, int):
        return config.gossip_steps
    ((unit, table),) = config.gossip_steps.items()
    at = k if unit == "step" else k // config.steps_per_epoch
    return table[max(start for start in table if start <= at)]


def _decentlam_gradients(replicas: list[nn.Module], optimizers: list, mix: Callable) -> None:
    """``g̃_i = (x_i − Σ_j w_ij z_j) / γ`` with ``z_j = x_j − γ g_j`` (``W g`` at ``γ = 0``), into ``.grad``."""
    lr = optimizers[0].param_groups[0]["lr"]
    x = torch.stack([_flat(r) for r in replicas]).double()
    g = torch.stack([torch.cat([p.grad.reshape(-1) for p in r.parameters()]) for r in replicas]).double()
    modified = mix(g) if lr == 0 else (x - mix(x - lr * g)) / lr
    for replica, row in zip(replicas, modified):
        offset = 0
        for p in replica.parameters():
            p.grad.copy_(row[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def assert_every_rank_matches(
    trained: list[dict[str, torch.Tensor]], config: Config, world_size: int, atol: float = 1e-5
) -> torch.Tensor:
    """Each rank's trained parameters (and buffers) equal the reference's row to ``atol``; returns the reference."""
    expected = run(config, world_size)
    for rank in range(world_size):
        torch.testing.assert_close(
            trained[rank][config.name].double(), expected[rank].double(), atol=atol, rtol=0, msg=f"rank {rank}"
        )
    return expected
