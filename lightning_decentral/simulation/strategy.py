"""`SimulatedDecentralizedStrategy`: `n` decentralized workers in one process, the same run as `n` processes.

Worker `i` is a copy of the LightningModule (worker 0 is the module itself) with its own optimizer,
gradients, BatchNorm statistics and torch random state; it sees the batches Lightning's
`DistributedSampler` gives rank `i` of `n`. The update rules are the objects of
[`lightning_decentral.rules`][lightning_decentral.rules], one per worker, over one
[`DenseMixer`][lightning_decentral.mixing.DenseMixer]. One optimizer step runs phase by phase:

```text
on_train_batch_start   every worker: rule.begin_step(plan)                  AWC posts x(k)
closure                every worker: training_step on its batch, backward   DecentLaM posts z per bucket
                       every rule's closure wrapper; every worker: clip; rule.gradients_ready()
                       every worker: optimizer.step()                       (waits, U)
                       every worker: rule.end_step(); then rule.finish_step()
```

When stacked (`vectorize=True`, or `"auto"` where stacking gives the same run) the workers are a
[`StackedWorkers`][lightning_decentral.simulation.vectorized.StackedWorkers]: each line above is one batched call for
every worker (one `torch.vmap` of `training_step`, one backward, one optimizer step, one rule), with the same result.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_decentral._compat.lightning import uses_distributed_sampler
from lightning_decentral.common import backward_may_overlap
from lightning_decentral.driver import Driven, StepDriver
from lightning_decentral.mixing import SIMULATION
from lightning_decentral.options import gossip_options, probe_outer_optimizer, refuse_sharding, takes_gossip_options
from lightning_decentral.rules import RuleContext, check_one_optimizer
from lightning_decentral.simulation.data import WorkerLoaders, first_batch_together
from lightning_decentral.simulation.hooks import WorkerHooks
from lightning_decentral.simulation.isolation import random_states_kept
from lightning_decentral.simulation.rejoins import Comings, checked_rejoins
from lightning_decentral.simulation.replicas import SimulatedReplicaStrategy, log_over_workers
from lightning_decentral.simulation.vectorized import (
    StackedWorkers,
    rows_clipped_apart,
    stacking_problem,
    stacking_trial,
    vectorization_problem,
)
from lightning_decentral.simulation.workers import SimulatedWorkers, checked_failures, copy_of, optimizer_like

STACKED_COMPRESSION = (
    "compression= compresses each worker's flat buffers (scales and indices over all its parameters), which the "
    "stacked rows, one tensor per parameter, do not hold together"
)


@takes_gossip_options
class SimulatedDecentralizedStrategy(Driven, SimulatedReplicaStrategy):
    """`workers` decentralized workers in one process, on one CPU or GPU: the run `DecentralizedStrategy`
    makes on `workers` processes, replica for replica (docs/simulation.md).

    The update-rule arguments are [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy]'s (the details
    are there). Use it with `devices=1`; the DataLoader's `batch_size` is the per-worker batch, as on processes.

    Args:
        workers: the number of simulated workers `n`.
        **options: the update-rule arguments, keyword only, as on processes
            ([`GossipOptions`][lightning_decentral.options.GossipOptions] describes each): `topology` (bound to
            `workers`), `combine`, `momentum`, `gossip_every`, `gossip_steps`, `gossip_buffers`, `eval_on`
            (`"local"`: worker 0's replica), `bucket_cap_mb` (it changes nothing here but the grouping), `gossip_dtype`
            (what the workers exchange is rounded as the processes would send it), `staleness` and `delays` (the
            processes under the same `delays` give the same replicas; `None`: `τ = k`), `outer_optimizer` and
            `outer_overlap` (not `outer_overlap` with `failures`), `compression` and `consensus_step` (the workers kept
            apart, without `failures`; `compression_overlap` changes nothing here: one thread runs every worker).
            `on_peer_failure` must stay `"stop"` and `min_workers` is only checked against `workers`: a lost worker is
            `failures=`; `shard_size` must stay 1 (the workers are whole models).
        vectorize: `"auto"` (the default): stack the workers when stacking gives the per-worker result (an
            elementwise optimizer, no dropout layer, no hook that sees one worker's batch or gradients, a DataLoader
            with a `batch_size`; see [`stacking_problem`][lightning_decentral.simulation.vectorized.stacking_problem]),
            else keep them apart; one info line says which and why. `True`: run the workers together (stacked
            parameters, one `torch.vmap` of `training_step`, one optimizer step for all; 2-3 times faster at
            `n = 16-64`), refusing what it cannot run (a non-elementwise optimizer; random numbers in
            `training_step` stop the first step). `False`: one worker at a time, for any module.
        failures: `{step: [workers]}`: those workers (by their first rank) die at that optimizer step, as
            `DecentralizedStrategy(on_peer_failure="continue")` survives it on processes: the step is a local step
            for the survivors (its exchange is discarded), and from the next one they mix with the topology of the
            survivors ([`for_members`][lightning_decentral.topology.Topology.for_members]). Each survivor keeps its
            replica, optimizer state and data; the lost workers' data is not visited. Runs the workers apart
            (`vectorize="auto"` keeps them apart; `True` is refused), with `staleness=0`.
        rejoins: `{step: [workers]}`: workers lost by `failures` come back at the start of that step, as with
            `rejoin=True` on processes ([`Comings`][lightning_decentral.simulation.rejoins.Comings]).
        accelerator: Lightning's accelerator (the Trainer's `accelerator=` sets it).
        checkpoint_io: writes and reads the checkpoint file (default: an
            [`AtomicCheckpointIO`][lightning_decentral.files.AtomicCheckpointIO], whole or not at all).
        precision_plugin: Lightning's precision plugin (the Trainer's `precision=` sets it).

    Example:
        ```python
        trainer = Trainer(strategy=SimulatedDecentralizedStrategy(workers=64, topology="ring"), devices=1)
        trainer = Trainer(strategy="dpsgd_sim", devices=1)  # 8 workers
        ```
    """

    strategy_name = "dpsgd_sim"
    # every worker's, not Driven's default of one worker per process (Driven comes first among the bases)
    worker_batches = SimulatedReplicaStrategy.worker_batches
    worker_random_states = SimulatedReplicaStrategy.worker_random_states

    def __init__(
        self,
        workers: int = 8,
        *,
        vectorize: bool | Literal["auto"] = "auto",
        failures: dict[int, list[int]] | None = None,
        rejoins: dict[int, list[int]] | None = None,
        accelerator: Any | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **options: Any,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"`workers` must be a positive integer (the simulated workers), got {workers!r}.")
        gossip = gossip_options(type(self).__name__, **options)
        refuse_sharding(gossip, type(self).__name__, "its workers are whole models in one process")
        if gossip.on_peer_failure != "stop":
            raise ValueError(
                f"on_peer_failure={gossip.on_peer_failure!r} is for processes; in the simulation, name the workers "
                "lost at each step with failures={step: [workers]}."
            )
        if not isinstance(vectorize, bool) and vectorize != "auto":
            raise ValueError(f"`vectorize` must be True, False or 'auto', got {vectorize!r}.")
        driver = StepDriver(gossip, epoch=self._epoch, phrasing=SIMULATION)
        driver.bind(workers, warn=rank_zero_warn)
        super().__init__(
            driver,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.vectorize = vectorize
        self.failures = checked_failures(failures, workers, vectorize, gossip.staleness)
        self.rejoins = checked_rejoins(rejoins, self.failures)
        if self.failures and gossip.outer_overlap:
            raise ValueError(
                "SimulatedDecentralizedStrategy(failures=...) rebuilds the graph between two steps, which "
                "outer_overlap=True (an exchange in flight across steps) does not support: use outer_overlap=False "
                "with failures."
            )
        if vectorize is True and gossip.compression is not None:
            raise ValueError(
                f"vectorize=True cannot run compression=: {STACKED_COMPRESSION}. Use vectorize=False or 'auto'."
            )
        if self.failures and gossip.compression is not None:
            raise ValueError(
                "failures= simulates on_peer_failure='continue', which compressed gossip does not support (the "
                "survivors' graph would need new public copies on both ends of every edge): drop failures= or "
                "compression=."
            )
        self._others_ready = False  # workers 1..n-1 clipped and ready at this step
        self._losses: list[Tensor] = []  # each worker's loss of this backward (divided for accumulation)
        self._outputs: list[Any] = []  # each worker's training_step output of this batch
        self._hooks: WorkerHooks | None = None  # the module's hooks on every worker (per-worker path)
        self._comings: Comings | None = None  # failures= and rejoins= (per-worker path)
        self._context: RuleContext | None = None  # the rules' context, kept to stack the workers later
        self._undecided = False  # vectorize="auto": the path is chosen at the first training DataLoader
        self._setting_up = False  # inside Lightning's setup (the optimizers built), before the workers exist
        self._early: tuple[torch.utils.data.DataLoader, WorkerLoaders] | None = None  # the training data loaded then

    # -- set-up -----------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        """Before each stage; before fit, also the workers: module copies, optimizers, replicas, rules."""
        self._early = None
        self._setting_up = True  # configure_optimizers may load the training data (estimated_stepping_batches)
        try:
            super().setup(trainer)
        finally:
            self._setting_up = False
        self._rng_restored = False
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.driver.bind(self.workers, warn=rank_zero_warn)  # a fit starts with every worker
        self._mixer = self.driver.dense_mixer()  # and, under staleness, from its first step k₀, as on processes
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("SimulatedDecentralizedStrategy needs automatic optimization; use DecentralizedStrategy.")
        check_one_optimizer(self.optimizers, "`configure_optimizers` returned")
        self.driver.check_length(trainer.max_steps, rank_zero_warn)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise ValueError(
                "The simulation does not run under a GradScaler (16-mixed): use precision='bf16-mixed' or '32-true'."
            )
        context = RuleContext(
            bucket_bytes=self.options.bucket_bytes,
            overlap_backward=backward_may_overlap(module),
            warn=rank_zero_warn,
            before_wait=self._ready_other_workers,
        )
        modules = [module] + [copy.deepcopy(module) for _ in range(self.workers - 1)]
        for copied in modules[1:]:  # a LightningModule leaves its Trainer out of copies: attach it
            copied.trainer = trainer
        self._context = context
        if self.vectorize is True:
            problem = vectorization_problem(module, self.optimizers[0], self._outer_probe())
            if problem:
                raise ValueError(
                    f"SimulatedDecentralizedStrategy(vectorize=True) cannot run this module: {problem}. Use "
                    "vectorize=False."
                )
            self._group = StackedWorkers(
                modules,
                self.optimizers[0],
                self.driver.make_rule,
                self.gossip_buffers,
                context,
                self._mixer,
                self.root_device,
            )
        else:  # "auto" stacks them, if it can, when it sees the training DataLoader
            self._group = self._workers_apart(modules, context)
            self._undecided = self.vectorize == "auto"
        self.driver.run(self._group, self._group, self._group)
        if self._early is not None:  # the training data was loaded before the workers existed: they follow it now
            dataloader, loaders = self._early
            if self._undecided:
                self._choose_path(dataloader)
            loaders.follow(self._group.as_worker, together=isinstance(self._group, StackedWorkers))

    def _outer_probe(self) -> Optimizer | None:
        """What `outer_optimizer` builds (whether it is elementwise decides if the workers can be stacked), or
        `None`."""
        factory = self.options.outer_optimizer
        return None if factory is None else probe_outer_optimizer(factory)

    def _workers_apart(self, modules: list[Module], context: RuleContext) -> SimulatedWorkers:
        """The per-worker path: each worker's own optimizer (worker 0's is Lightning's), replica and rule, and the
        module's hooks on every worker."""
        group = SimulatedWorkers(self._mixer, self.root_device)
        quiet = dataclasses.replace(context, warn=_quiet)
        make = self.driver.make_rule
        self._comings = Comings(self.failures, self.rejoins, self.driver.topology, lambda *made: make(*made, quiet))
        for rank, worker_module in enumerate(modules):
            optimizer = (
                self.optimizers[0]
                if rank == 0
                else optimizer_like(self.optimizers[0], copy_of(modules[0], worker_module))
            )
            group.add(
                worker_module, optimizer, self.driver.make_rule, self.gossip_buffers, context if rank == 0 else quiet
            )
        self._hooks = WorkerHooks(group, losses=lambda: self._losses, outputs=lambda: self._outputs)
        self._hooks.install()
        return group

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader becomes one per worker, each with rank `i`'s `DistributedSampler` (stacked: one
        for all). With `vectorize="auto"`, the first one decides the path."""
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        if self._undecided:
            self._choose_path(dataloader)
        together = isinstance(self._group, StackedWorkers)
        loaders = WorkerLoaders(
            dataloader,
            self.workers,
            self._group.as_worker,
            together=together,
            origins=lambda: self._comings.visited(self._group) if self._comings else self._group.origins,
            **self._sampling(),
        )
        if self._setting_up:  # before the workers exist (configure_optimizers read estimated_stepping_batches)
            self._early = (dataloader, loaders)
        return loaders

    def _sampling(self) -> dict[str, Any]:
        """How the Trainer would give `n` processes the training data: its `use_distributed_sampler` and
        `overfit_batches` (the arguments of [`rank_samplers`][lightning_decentral.simulation.data.rank_samplers])."""
        trainer = self.lightning_module.trainer
        return {"distributed": uses_distributed_sampler(trainer), "overfit_batches": trainer.overfit_batches}

    def _choose_path(self, dataloader: torch.utils.data.DataLoader) -> None:
        """`vectorize="auto"`, before training: stack the workers if that gives the per-worker result (what can be seen
        of the module, optimizer and data, then a trial of `training_step` under `torch.vmap` and the run's precision
        on every worker's first batch, which changes nothing), and say which path runs and why (one info line)."""
        self._undecided = False
        optimizer = self.optimizers[0]
        problem = stacking_problem(
            self.lightning_module, optimizer, dataloader.batch_size, dataloader, self._outer_probe()
        )
        if self.workers == 1:
            problem = "there is one worker: nothing to stack"
        if self.failures:
            problem = "failures= drops workers one by one, which the stacked rows do not support"
        if self.options.compression is not None:
            problem = STACKED_COMPRESSION
        if problem is None:
            with random_states_kept(), self.precision_plugin.train_step_context():
                batch = self.batch_to_device(first_batch_together(dataloader, self.workers, **self._sampling()))
                problem = stacking_trial(self._group.modules, batch, lambda module, part: module.training_step(part, 0))
        if problem is not None:
            return _say_path(f"the per-worker path, one worker at a time, because {problem}")
        assert self._hooks is not None and self._context is not None
        self._hooks.remove()
        self._hooks = None
        self._group = StackedWorkers.from_workers(
            self._group, optimizer, self.driver.make_rule, self.gossip_buffers, self._context, self._mixer
        )
        self.driver.run(self._group, self._group, self._group)
        optimizer_name = type(optimizer).__name__
        _say_path(
            f"the stacked path, every worker in one batched call ({optimizer_name} is elementwise, no layer draws "
            "random numbers, no hook sees one worker's batch or gradients, training_step runs under torch.vmap)"
        )

    # -- one optimizer step, every worker ---------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each training batch: the workers `failures` names for this step die, those `rejoins` names come back
        ([`Comings`][lightning_decentral.simulation.rejoins.Comings]); every worker begins the optimizer step."""
        super().on_train_batch_start(batch, batch_idx)
        step = self.lightning_module.trainer.global_step
        if self._comings is not None:  # failures=: the workers kept apart (vectorize=True is refused with it)
            self._comings.at(step, cast(SimulatedWorkers, self._group), self.driver)
        self.driver.begin(step)

    @override
    def training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Each worker's `training_step` on its batch; what they log is logged once, as the mean over workers.

        Returns worker 0's output with the loss replaced by the mean loss over the workers.
        """
        trainer = self.lightning_module.trainer
        if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
            self._group.zero_grad_others()  # Lightning zeroes worker 0's gradients, as on every rank
        with self.precision_plugin.train_step_context():
            outputs, logged = self._group.training_steps(
                batch, lambda module, part: module.training_step(part, *args, **kwargs)
            )
        log_over_workers(self.lightning_module, logged, len(self._group.modules))
        self.lightning_module.log_dict(self.driver.bytes_metrics(self.workers), on_step=True, on_epoch=False)
        self._outputs = outputs
        self._losses = [_loss_of(output) for output in outputs]
        if any(loss is None for loss in self._losses):
            raise ValueError("A worker's training_step returned no loss: every simulated worker must step together.")
        mean_loss = torch.stack([loss.detach() for loss in self._losses]).mean()  # backward is per worker
        first = outputs[0]
        return {**first, "loss": mean_loss} if isinstance(first, dict) else mean_loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Each worker's backward of its own loss (scaled as Lightning scales the returned one)."""
        self.pre_backward(closure_loss)
        self._group.before_backward()
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        self._losses = [loss / accumulate for loss in self._losses]
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)  # on_before_backward

        def backward(loss: Tensor, module: Module, worker_optimizer: Optimizer | None) -> None:
            self.precision_plugin.backward(loss, module, worker_optimizer, *args, **kwargs)

        self._group.backward(self._losses, backward)
        self._losses = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Around the backward of accumulated micro-batches (DecentLaM posts no bucket there)."""
        with self._group.no_backward_sync():
            yield

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """One step of every worker, phase by phase (see the module docstring).

        Worker 0 steps through Lightning's own path (closure, `on_before_optimizer_step`, clipping,
        precision); its closure runs every worker's forward and backward. The other workers are clipped and
        told their gradients are final before worker 0 waits for an exchange (DecentLaM) or steps, then step.
        """
        lightning_step = super().optimizer_step
        self._others_ready = False

        def run(closure: Callable[[], Any]) -> Any:
            results: list[Any] = []

            def every_worker() -> Any:
                results.append(closure())  # every worker's forward and backward, then every rule's wrapper
                return results[0]

            rows = self._group if isinstance(self._group, StackedWorkers) else None
            with rows_clipped_apart(self.precision_plugin, rows):
                output = lightning_step(optimizer, every_worker, model, **kwargs)
            self._ready_other_workers()
            self._group.step_others(results[0])
            return output

        return self.driver.optimizer_step(self.lightning_module.trainer.global_step, run, closure)

    def _ready_other_workers(self) -> None:
        """Once per step, after worker 0's `on_before_optimizer_step` and clipping: clip workers 1..n-1 (their
        LightningModule hook) and tell their rules the gradients are final (DecentLaM posts what is left)."""
        if self._others_ready:
            return
        self._others_ready = True
        trainer = self.lightning_module.trainer
        self._group.ready_others(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)

    def _epoch(self) -> int:
        """The Trainer's current epoch: what a `gossip_steps` schedule by epoch reads (restored on resume)."""
        return self.lightning_module.trainer.current_epoch

    @override
    def on_train_end(self) -> None:
        """After the last training batch: finish anything still in flight."""
        self.driver.drain()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        """After the stage: release the rules' hooks and worker 0's own module hooks."""
        self.driver.teardown()
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register `"dpsgd_sim"` and `"decentlam_sim"` (8 workers)."""
        for name, momentum in (("dpsgd_sim", "local"), ("decentlam_sim", "decentlam")):
            strategy_registry.register(
                name,
                cls,
                description=f"Decentralized training simulated in one process, momentum={momentum!r}",
                override=True,
                momentum=momentum,
            )


def _quiet(message: str) -> None:
    """Workers 1..n-1 warn nothing: worker 0 warns once for all."""


def _loss_of(output: Any) -> Tensor | None:
    return output["loss"] if isinstance(output, dict) else output


def _say_path(which: str) -> None:
    """The one info line of `vectorize="auto"`."""
    rank_zero_info(f"SimulatedDecentralizedStrategy(vectorize='auto'): {which}. vectorize=True or False chooses.")
