"""Local steps with an outer optimizer, written from the papers, independently of ``lightning_decentral``.

``diloco(config, n)`` is Algorithm 1 of DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"): one global model ``θ``; at each outer step every worker copies ``θ``, takes ``H``
inner steps of its own optimizer on its own data (the inner optimizer's state carries over from round to round),
the outer gradient is ``Δ = (1/n) Σ_i (θ − θ_i)``, and ``θ <- OuterOpt(θ, Δ)``.

``decentralized(config, n)`` is docs/algorithms.md's decentralized form: one anchor per worker, the outer gradient
``Δ̃_i = θ_i − Σ_j w_ij x_j`` from the mixed models; with ``config.outer_overlap`` the outer step of a round is
taken at the end of the next one, with that round's progress kept: ``x_i <- θ_i + (x_i − y_i)``. With
``config.failures``, the workers lost at step ``k`` leave before it, ``W(k) = I`` for the others, and from ``k + 1``
they mix with the named topology at their number. With ``config.compression`` the round's models travel as CHOCO's
messages and the mixed model is taken from the public copies (``tests.choco_reference.ChocoReference`` with
``from_copy``), ``x̃_i = x̂_i + γ (Σ_j w_ij x̂_j − x̂_i)``, every copy starting at the common initial model.

The outer optimizer is SGD with (Nesterov) momentum, written out as torch documents ``torch.optim.SGD``
(no dampening): ``b <- μ b + g`` (``b = g`` at the first step), ``d = g + μ b`` with Nesterov, else ``b``;
``θ <- θ − lr d``. Data, initial weights and the inner optimizer are those of ``tests.reference.run``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.choco_reference import ChocoReference
from tests.models import init_seed, initial_net, make_optimizer, rank_data
from tests.reference import Config, gossip, mixing, scheduled_rounds


class OuterSGD:
    """``torch.optim.SGD``'s update, by hand, on the rows of a float64 tensor (one row per worker)."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False) -> None:
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buffer: torch.Tensor | None = None

    def step(self, theta: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        if self.momentum:
            self.buffer = gradient.clone() if self.buffer is None else self.momentum * self.buffer + gradient
            direction = gradient + self.momentum * self.buffer if self.nesterov else self.buffer
        else:
            direction = gradient
        return theta - self.lr * direction


class _Workers:
    """``n`` workers of ``config``: rank 0's initial net everywhere, an inner optimizer each, their data."""

    def __init__(self, config: Config, n: int) -> None:
        assert config.accumulate == 1 and config.clip is None and config.scheduler is None
        start = initial_net(init_seed(0), config.batch_norm).to(config.dtype)
        self.config, self.n = config, n
        self.nets = [copy.deepcopy(start) for _ in range(n)]
        self.optimizers = [make_optimizer(net.parameters(), **config.optimizer) for net in self.nets]
        self.data = [rank_data(i, config.samples, config.dtype) for i in range(n)]

    def keep(self, rows: list[int]) -> None:
        """Only the workers at positions ``rows`` go on."""
        self.nets, self.optimizers, self.data = ([v[i] for i in rows] for v in (self.nets, self.optimizers, self.data))

    def inner_step(self, k: int) -> None:
        rows = slice(k * self.config.batch_size, (k + 1) * self.config.batch_size)
        for net, optimizer, (x, y) in zip(self.nets, self.optimizers, self.data):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
            optimizer.step()

    def parameters(self) -> torch.Tensor:
        return torch.stack(
            [torch.cat([p.detach().reshape(-1) for p in net.parameters()]) for net in self.nets]
        ).double()

    def buffers(self) -> torch.Tensor:
        rows = [[b.reshape(-1) for b in net.buffers() if b.is_floating_point()] for net in self.nets]
        return torch.stack([torch.cat(r) if r else torch.zeros(0) for r in rows]).double()

    def assign(self, parameters: torch.Tensor, buffers: torch.Tensor) -> None:
        for net, row, buffer_row in zip(self.nets, parameters, buffers):
            tensors = list(net.parameters()) + [b for b in net.buffers() if b.is_floating_point()]
            values = torch.cat([row, buffer_row])
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(values[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def state(self) -> torch.Tensor:
        return torch.cat([self.parameters(), self.buffers()], dim=1)


def mixed(
    y: torch.Tensor, config: Config, step: int, rounds: int, choco: ChocoReference | None = None, key: int = 0
) -> torch.Tensor:
    """``W(step)^rounds y`` (with ``config.gossip_dtype``, the low-precision rule) for the rows of ``y``, as
    ``tests.reference.gossip`` writes it; with ``choco`` (``config.compression``) CHOCO's rounds on the public copies
    of buffer ``key``, ``y_i + γ (Σ_j w_ij ŷ_j − Σ_j w_ji ŷ_i)``; a row of width 0 (no buffers) as it is."""
    if not y.shape[1] or not rounds:
        return y
    return choco.mix(y, step, rounds, key) if choco is not None else gossip(y, config, step, rounds)


def diloco(config: Config, n: int) -> torch.Tensor:
    """DiLoCo's Algorithm 1 (see the module docstring): every worker's parameters and floating buffers after
    ``config.steps`` inner steps (the buffers, not in the paper, are averaged at each outer step)."""
    workers = _Workers(config, n)
    theta = workers.parameters()[0]  # the global model
    outer = OuterSGD(**config.outer)
    for k in range(config.steps):
        workers.inner_step(k)
        if (k + 1) % config.gossip_every == 0:
            delta = (theta - workers.parameters()).mean(0)  # the outer gradient
            theta = outer.step(theta, delta)
            buffers = workers.buffers().mean(0, keepdim=True).expand(n, -1)
            workers.assign(theta.expand(n, -1), buffers)  # every worker restarts from θ
    return workers.state()


def decentralized(config: Config, n: int) -> torch.Tensor:
    """The decentralized form (see the module docstring), with ``W(k)`` of ``tests.reference.mixing``."""
    workers = _Workers(config, n)
    anchors = workers.parameters()
    outer = OuterSGD(**config.outer)
    sent: tuple[int, torch.Tensor, torch.Tensor] | None = None  # overlap: (step, y, its buffers)
    alive = list(range(n))
    choco = None  # compressed: the exchange of tag t numbers its parameters t, its buffers t + 1 (overlap: t = 1)
    assert config.compression is None or not config.failures
    tag = int(config.outer_overlap)
    if config.compression is not None:  # every copy starts at the models every worker starts from
        origins = {tag: workers.parameters()[0], tag + 1: workers.buffers()[0]}
        choco = ChocoReference(
            config.compression,
            config.consensus_step,
            lambda step: mixing(config.topology, n, config.phase(step)),
            True,
            origins,
        )
    for k in range(config.steps):
        lost = config.failures.get(k, [])
        if lost:
            rows = [i for i, rank in enumerate(alive) if rank not in lost]
            alive, anchors = [alive[i] for i in rows], anchors[rows]
            workers.keep(rows)
            if outer.buffer is not None:
                outer.buffer = outer.buffer[rows]
        n = len(alive)
        workers.inner_step(k)
        if (k + 1) % config.gossip_every:
            continue
        x, b = workers.parameters(), workers.buffers()
        rounds = 0 if lost else scheduled_rounds(config, k)
        mix = lambda y, key, step=k, rounds=rounds: mixed(y, config, step, rounds, choco, tag + key)  # noqa: E731
        if not config.outer_overlap:
            anchors = outer.step(anchors, anchors - mix(x, 0))
            workers.assign(anchors, mix(b, 1))
            continue
        if sent is not None:
            _step, y, y_buffers, y_mixed, b_mixed = sent
            anchors = outer.step(anchors, anchors - y_mixed)
            x, b = anchors + (x - y), b + b_mixed - y_buffers
            workers.assign(x, b)
        sent = (k, x, b, mix(x, 0), mix(b, 1))  # the exchange of y, posted now (CHOCO's copies move now)
    return workers.state()
