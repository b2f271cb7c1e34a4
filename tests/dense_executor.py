"""A single-process executor of the update rules: ``n`` workers, one ``DenseMixer``, no torch.distributed.

It builds the workers exactly as ``tests.reference.run`` does (rank 0's initial net everywhere, one
optimizer and scheduler per worker, per-rank data, accumulation, clipping, BatchNorm) and drives
every worker's rule through the lifecycle of ``lightning_decentral.rules``. A ``DenseMixer`` computes
an exchange when the first worker waits for it, so every worker must start it before any worker
waits: each phase below runs for every worker before the next phase starts.

Phase order of one optimizer step ``k`` (the one that works for every rule):

1. ``rule.begin_step(plan)`` (AWC posts ``x(k)`` and the module buffers before the forward pass).
2. The closure of every worker, run by the executor itself, result cached, as Lightning nests it:
   ``rule.wrap_closure(forward_backward)`` inside the precision plugin's wrapper, which clips after it.
   ``forward_backward`` zeroes the gradients and runs the accumulated micro-batches, calling
   ``rule.before_backward()`` before each backward and running every micro-batch but the last
   inside ``rule.no_backward_sync()``. AWC waits for ``x(k)`` right after it (every worker posted at
   phase 1); DecentLaM's gradient hooks post ``z`` bucket by bucket during the last backward and its
   wrapper posts what is left.
   After clipping, ``rule.gradients_ready()``: DecentLaM with clipping (``overlap_backward=False``, as
   the Trainer strategy chooses) posts ``z`` there. On processes its optimizer pre-hook posts after
   clipping and waits in one call; a DenseMixer cannot serve a worker that waits before the others
   posted, so the executor posts in this phase (the pre-hook then finds nothing left to post).
3. ``optimizer.step(closure=lambda: cached)`` of every worker (DecentLaM's pre-hook calls that
   closure, waits for ``z`` (all posted in phase 2) and writes ``g̃`` before ``U``).
4. ``rule.end_step()`` (AWC adds ``W x(k) − x(k)``; ATC posts ``U(x)``; DecentLaM posts the buffers).
5. ``rule.finish_step()`` (ATC, DecentLaM's buffers: wait and combine), then ``scheduler.step()``.

Running one worker's whole step before the next worker's fails with the DenseMixer's RuntimeError
(the first wait of an exchange that the other workers have not started).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_decentral.compression import resolve_compression
from lightning_decentral.mixing import DelayedMixing, DenseMixer, ExchangeObserver
from lightning_decentral.options import rule_name
from lightning_decentral.outer import OuterStep
from lightning_decentral.replicas import Replica
from lightning_decentral.rules import RULES, RuleContext, UpdateRule
from lightning_decentral.schedule import GossipSchedule
from lightning_decentral.topology import resolve_topology
from tests.models import init_seed, initial_net, make_optimizer, make_scheduler, rank_data
from tests.reference import Config


class DenseExecutor:
    """``n`` workers of ``config`` in one process, each with its rule, sharing one ``DenseMixer``.

    Args:
        config: the run (the same object ``tests.reference.run`` takes).
        n: the number of workers.
        measure_residuals: set ``mixer.measure_residuals``.
        observers: added to the dense mixer's observers (they see every worker's exchanges).
    """

    def __init__(
        self, config: Config, n: int, measure_residuals: bool = False, observers: Sequence[ExchangeObserver] = ()
    ) -> None:
        self.config, self.n = config, n
        start = initial_net(init_seed(0), config.batch_norm).to(config.dtype)  # rank 0's initial weights
        self.modules = [copy.deepcopy(start) for _ in range(n)]
        self.replicas = [Replica(module, mix_buffers=True) for module in self.modules]
        self.optimizers = [make_optimizer(m.parameters(), **config.optimizer) for m in self.modules]
        self.schedulers = [make_scheduler(o, config.scheduler) for o in self.optimizers]
        self.data = [rank_data(i, config.samples, config.dtype) for i in range(n)]
        topology = resolve_topology(config.topology, n)
        delayed = DelayedMixing(topology, config.staleness, config.delays) if config.staleness else None
        compression = resolve_compression(config.compression)
        self.schedule = GossipSchedule(topology, config.gossip_every, config.gossip_steps)
        self.mixer = DenseMixer(
            self.schedule.topology,  # a time-varying topology: one matrix per gossip round
            config.gossip_dtype,
            delayed,
            compression=compression,
            consensus_step=config.consensus_step,
            from_copy=config.outer is not None,  # the outer step's compressed mixing, as the driver builds it
        )
        self.mixer.measure_residuals = measure_residuals
        self.mixer.observers.extend(observers)
        self.warnings: list[str] = []
        self.context = RuleContext(
            bucket_bytes=int(config.bucket_cap_mb * 2**20),
            overlap_backward=config.clip is None,  # as DecentralizedStrategy: clipping needs every gradient first
            warn=self.warnings.append,
        )
        cls = RULES[rule_name(config.momentum, config.combine)]
        if config.outer is not None:
            cls = functools.partial(
                OuterStep,
                outer_optimizer=config.outer_optimizer(),
                every=config.gossip_every,
                overlap=config.outer_overlap,
            )
        self.rules: list[UpdateRule] = [
            cls(replica, self.mixer.worker(i), optimizer, self.context)
            for i, (replica, optimizer) in enumerate(zip(self.replicas, self.optimizers))
        ]

    def forward_backward(self, i: int, k: int) -> Callable[[], torch.Tensor]:
        """Worker ``i``'s closure at step ``k``: zero the gradients, forward and backward every micro-batch."""
        config, module, rule = self.config, self.modules[i], self.rules[i]
        inputs, targets = self.data[i]

        def closure() -> torch.Tensor:
            self.optimizers[i].zero_grad()
            total = torch.zeros(())
            for a in range(config.accumulate):
                first = (k * config.accumulate + a) * config.batch_size
                rows = slice(first, first + config.batch_size)
                loss = nn.functional.mse_loss(module(inputs[rows]), targets[rows]) / config.accumulate
                last = a == config.accumulate - 1
                rule.before_backward()
                if last:
                    loss.backward()
                else:
                    with rule.no_backward_sync():
                        loss.backward()
                total = total + loss.detach()
            return total

        return closure

    def step(
        self,
        k: int,
        after_closures: Callable[[int], None] | None = None,
        after_update: Callable[[int], None] | None = None,
    ) -> None:
        """Optimizer step ``k`` of every worker, phase by phase (the module docstring).

        ``after_closures(k)`` runs when every closure has run (the gradients are the clipped ``g``),
        ``after_update(k)`` when every optimizer has stepped, before ``end_step``.
        """
        plan = self.schedule.plan(k, epoch=k // self.config.steps_per_epoch if self.config.steps_per_epoch else 0)
        for rule in self.rules:  # 1
            rule.begin_step(plan)
        results: list[Any] = []
        for i, rule in enumerate(self.rules):  # 2
            result = rule.wrap_closure(self.forward_backward(i, k))()
            if self.config.clip is not None:  # the precision plugin clips after the (wrapped) closure
                nn.utils.clip_grad_norm_(self.modules[i].parameters(), self.config.clip)
            rule.gradients_ready()
            results.append(result)
        if after_closures is not None:
            after_closures(k)
        for optimizer, result in zip(self.optimizers, results):  # 3
            optimizer.step(closure=lambda result=result: result)
        if after_update is not None:
            after_update(k)
        for rule in self.rules:  # 4
            rule.end_step()
        for rule, scheduler in zip(self.rules, self.schedulers):  # 5
            rule.finish_step()
            if scheduler is not None:
                scheduler.step()

    def run(self, steps: int | None = None) -> torch.Tensor:
        """``steps`` (default ``config.steps``) steps; every worker's state, as ``tests.reference.run`` returns it."""
        try:
            for k in range(self.config.steps if steps is None else steps):
                self.step(k)
        finally:
            for rule in self.rules:
                rule.teardown()
        return self.state()

    def state(self) -> torch.Tensor:
        """``n × d``: each worker's parameters, then its floating-point buffers."""
        return torch.stack([flat_state(m) for m in self.modules])

    def parameters(self) -> torch.Tensor:
        """``n × d``: each worker's trainable parameters (what the residual is measured on)."""
        return torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in self.modules])


def flat_state(module: nn.Module) -> torch.Tensor:
    tensors = [p.detach().reshape(-1) for p in module.parameters()]
    tensors += [b.reshape(-1) for b in module.buffers() if b.is_floating_point()]
    return torch.cat(tensors)
