"""`DecentralizedStrategy`: Lightning's DDP machinery, with gossip instead of all-reduce.

One optimizer step `k` on rank `i`, as the Trainer runs it (the update rule is an object of
[`lightning_decentral.rules`][lightning_decentral.rules]; this class only says when):

```text
on_train_batch_start   plan = schedule.plan(k); rule.begin_step(plan)      AWC posts x(k)
pre_backward           rule.before_backward()
optimizer_step         optimizer.step(rule.wrap_closure(closure))          forward, backward, U
                       rule.end_step(); rule.finish_step()                 combine
```

Gradients are never all-reduced and the module is never wrapped in `DistributedDataParallel`;
launching, cluster environments, samplers, `barrier`, `broadcast` and `reduce` are `DDPStrategy`'s own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_decentral import checkpoint as shards
from lightning_decentral._compat.lightning import set_device_mesh
from lightning_decentral.agreement import Ranks, optimizer_configuration, parameter_deviations, run_configuration
from lightning_decentral.common import Processes, backward_may_overlap, enabled_grad_scaler, launched_by_lightning
from lightning_decentral.driver import Driven, StepDriver
from lightning_decentral.measures import own_gradients
from lightning_decentral.membership import Decision, form_for_save
from lightning_decentral.mixing import Mixer
from lightning_decentral.options import gossip_options, register_strategies, takes_gossip_options
from lightning_decentral.rendezvous import job_store
from lightning_decentral.replicas import Replica
from lightning_decentral.rules import RuleContext
from lightning_decentral.sharding import (
    Sharding,
    check_same_sharding,
    local_tensors,
    sharded_optimizer_state,
)
from lightning_decentral.timeouts import DEFAULT_TIMEOUT, checked_timeout
from lightning_decentral.trainer.rejoin import handover_state, take_over_state
from lightning_decentral.trainer.replicated import ReplicaStrategy
from lightning_decentral.trainer.signals import stop_line, stop_together
from lightning_decentral.trainer.stop import StopAgreement, next_key, stop_margin

log = logging.getLogger(__name__)


@takes_gossip_options
class DecentralizedStrategy(Driven, ReplicaStrategy):
    """Decentralized data-parallel training: each rank keeps its own replica and gossips it.

    Update rules (docs/algorithms.md), with `U` the user's optimizer:

    * `combine="awc"`: `x_i(k+1) = Σ_j w_ij(k) x_j(k) + (U(x_i(k), g_i) − x_i(k))`; the
      exchange of `x(k)` overlaps the forward and backward pass.
    * `combine="atc"`: `x_i(k+1) = Σ_j w_ij(k) U(x_j(k), g_j)`.
    * `momentum="decentlam"`: `z_j = x_j − γ g_j`, `g̃_i = (x_i − Σ_j w_ij z_j) / γ`,
      `x_i(k+1) = U(x_i(k), g̃_i)`; each bucket of `z` is exchanged as soon as its gradients exist.
    * `outer_optimizer=...` with `gossip_every=H`: `H` local steps of `U`, then
      `θ_i <- OuterOpt(θ_i, θ_i − Σ_j w_ij x_j)` and `x_i <- θ_i`; DiLoCo on `topology="complete"`.

    Args:
        **options: the update-rule arguments, keyword only: `topology`, `combine`, `momentum`, `gossip_every`,
            `gossip_steps`, `gossip_buffers`, `eval_on`, `bucket_cap_mb`, `gossip_dtype`, `staleness`, `delays`,
            `on_peer_failure`, `min_workers`, `outer_optimizer`, `outer_overlap`, `compression`, `consensus_step`,
            `compression_overlap`, `shard_size` (replicas of several ranks, FSDP2 inside: docs/sharded.md)
            ([`GossipOptions`][lightning_decentral.options.GossipOptions] describes each;
            `tests/test_options_docs.py` checks this list against it); a misspelled name is a `TypeError`.
        resume: what `fit(ckpt_path=...)` resumes from: `"checkpoint"`, the checkpoint it names (`"last"` as Lightning
            resolves it); `"newest_complete"`, that one if every rank can read it and finds its shard, else the newest
            such checkpoint in its directory, with one warning naming both (for a job restarted after a failure:
            docs/reliability.md).
        accelerator: Lightning's accelerator (the Trainer's `accelerator=` sets it).
        parallel_devices: the devices of this node's ranks (the Trainer's `devices=` sets them).
        cluster_environment: how the ranks find each other (SLURM, TorchElastic, ...: detected when `None`).
        checkpoint_io: writes and reads the checkpoint file (default: an
            [`AtomicCheckpointIO`][lightning_decentral.files.AtomicCheckpointIO], whole or not at all).
        precision_plugin: Lightning's precision plugin (the Trainer's `precision=` sets it).
        process_group_backend: `"gloo"` or `"nccl"` (default: NCCL on GPUs, gloo on the CPU).
        timeout: how long a rank waits for a silent peer (the rendezvous, a collective, an exchange) before it stops
            with an error naming it; default 5 minutes (`DEFAULT_TIMEOUT`). Ranks that run different collectives
            stop at once.
        start_method: how the ranks are launched: `"popen"` (a script per rank), `"spawn"`, `"fork"`,
            `"forkserver"`.
        rejoin: with `on_peer_failure="continue"`, a lost rank started again (the same command and environment)
            rejoins the run in progress at a step the members agree on, from a neighbour's live state
            ([Rejoining](../reliability/rejoining.md)); `False`: it stops with `LeftOut`.

    No collective runs on the default group at every step: a SIGTERM on any rank stops every rank at the same
    step, agreed through the job's store ([`stop`][lightning_decentral.trainer.stop]), in place of Lightning's broadcast
    from rank 0 at every batch.

    Examples:
        ```python
        import lightning_decentral  # registers "dpsgd", "decentlam" and their "_spawn" and "_fork" variants
        trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4)
        trainer = Trainer(strategy=DecentralizedStrategy(topology="one_peer_exponential"), devices=8)
        trainer = Trainer(strategy="decentlam", devices=8)  # large batch, momentum SGD
        diloco = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        trainer = Trainer(strategy=DecentralizedStrategy(topology="complete", gossip_every=50, outer_optimizer=diloco))
        ```
    """

    strategy_name = "dpsgd"

    def __init__(
        self,
        *,
        resume: Literal["checkpoint", "newest_complete"] = "checkpoint",
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        rejoin: bool = False,
        **options: Any,
    ) -> None:
        gossip = gossip_options(type(self).__name__, **options)
        if rejoin and gossip.on_peer_failure != "continue":
            raise ValueError(
                "rejoin=True lets a lost rank rejoin the survivors of a failure: pass on_peer_failure='continue' with "
                "it."
            )
        if rejoin and gossip.shard_size > 1:
            raise ValueError(
                f"rejoin=True with shard_size={gossip.shard_size}: a lost replica would have to come back as "
                f"{gossip.shard_size} ranks at once, into a new FSDP process group of its own, while the members train "
                "on, which is not built. Use rejoin=False: on_peer_failure='continue' lets the other replicas go on "
                "without it, and a restart from the newest complete checkpoint trains every replica again."
            )
        driver = StepDriver(gossip, epoch=self._epoch)  # bound to the world size with the launcher
        sharding = Sharding(gossip.shard_size) if gossip.shard_size > 1 else None
        processes = Processes(
            driver,
            checked_timeout(timeout),
            ranks=self.ranks,
            rejoin=rejoin,
            handover=self._handover_state,
            join_margin=self._stop_margin,  # a join step is as far ahead as a stop step
            on_survivors=self._on_survivors,
            sharding=sharding,
        )
        super().__init__(
            driver,
            processes,
            resume=resume,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=processes.timeout,
            start_method=start_method,
        )
        self.sharding = sharding  # the same object Processes holds
        self._replica: Replica | None = None
        self._mixer: Mixer | None = None
        self._stops: StopAgreement | None = None  # this fit's agreement on a step to stop at after a SIGTERM

    # -- public surface: the monitors, tests and benchmarks read the strategy through these (and Driven's) ------

    @property
    def flat_parameters(self) -> list[Tensor]:
        """The flat buffers the trainable parameters are views of (one per device and dtype)."""
        return self._replica.flat_parameters if self._replica is not None else []

    @property
    def trained_module(self) -> LightningModule:
        """The LightningModule this rank trains (its replica)."""
        return self.lightning_module

    @property
    @override
    def replica_ranks(self) -> Ranks:
        """The ranks a mean over the replicas runs on: every rank; with sharded replicas, the ranks holding this rank's
        shard of every replica (its column of the device mesh)."""
        if self.sharding is not None:
            return self.sharding.replica_ranks(self.root_device, self.guard)
        return super().replica_ranks

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `‖p_i − p̄‖²` on this rank and `‖p̄‖²` (0-dim float64, `p̄`
        averaged in at least float32; one all-reduce: every rank calls it together). With sharded replicas, this
        rank's shard's part of its replica's term."""
        if self.sharding is not None:
            return self.sharding.parameter_deviations(self.replica_ranks, self.trained_module)
        return parameter_deviations(self.ranks(), self.trained_module)

    def gradient_sum(self) -> list[Tensor]:
        """This rank's gradient of each trainable parameter (zeros where it has none)."""
        return own_gradients(self.trained_module)

    @property
    def first_rank(self) -> int:
        """This rank's global rank when the run started (a failure renumbers the survivors)."""
        return self.processes.first_rank(self.global_rank)

    @property
    def start_size(self) -> int:
        """The number of ranks when the run started (a failure or a rejoin changes `world_size`)."""
        return self.processes.start_size(self.world_size)

    @property
    def failures_survived(self) -> list[Decision]:
        """The survivors' decisions of the run so far (or of the last one), one per failure survived."""
        return self.processes.failures_survived

    @property
    def start_method(self) -> str:
        """How Lightning's launcher starts the ranks: `start_method=`, or the registered name's (`"dpsgd_fork"`:
        `"fork"`); `"popen"` runs the script once per rank."""
        return self._start_method

    @property
    def launched_by_lightning(self) -> bool:
        """Whether Lightning's own launcher started this rank
        ([`launched_by_lightning`][lightning_decentral.common.launched_by_lightning])."""
        return launched_by_lightning(self.start_method, self.launcher, self.cluster_environment)

    # -- set-up -----------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        """Runs when the Trainer is built, before any process starts: refuse what the options cannot run with the
        plugins and the backend, then bind the topology (a bad one fails here)."""
        if self.options.on_peer_failure == "continue" and isinstance(self.checkpoint_io, AsyncCheckpointIO):
            raise ValueError(
                "on_peer_failure='continue' does not save in the background (AsyncCheckpointIO): its writer averages "
                "on a process group of every rank, which a failure breaks. Drop the AsyncCheckpointIO plugin, or use "
                "on_peer_failure='stop' (a restart resumes from the newest complete checkpoint)."
            )
        if self.sharding is not None and isinstance(self.checkpoint_io, AsyncCheckpointIO):
            raise ValueError(
                f"shard_size={self.options.shard_size} does not save in the background (AsyncCheckpointIO): the full x̄ "
                "of a checkpoint is gathered inside each replica, on the training's process groups. Drop the "
                "AsyncCheckpointIO plugin, or use shard_size=1."
            )
        self.processes.check_backend(self.process_group_backend, self.root_device)
        super()._configure_launcher()
        self.processes.bind(self.num_nodes * self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """Runs first in every Trainer run, before `configure_model`: with sharded replicas, the device mesh
        `("replica", "shard")`, given to the module as `self.device_mesh` (as Lightning's `ModelParallelStrategy`
        does)."""
        super().setup_environment()
        if self.sharding is not None:
            mesh = self.sharding.mesh or self.sharding.make_mesh(self.root_device.type, self.world_size, self._timeout)
            set_device_mesh(self.lightning_module, mesh)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Runs before fit, validate, test or predict: the replicas, then (fitting) the update rule and the stop
        agreement that replaces Lightning's per-batch SIGTERM broadcast."""
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_clipping(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.world_size > 1:
            self._agree_on_stops(trainer)  # before this fit's first collective
        super().setup(trainer)  # fitting: calls configure_ddp, then builds the optimizers
        if trainer.state.fn == TrainerFn.FITTING:
            self.driver.check_length(trainer.max_steps, rank_zero_warn)
            if self.processes.joining:
                self._rejoin_the_members()
            else:
                self.ranks().check_same_optimizers(self.optimizers)
                if self.processes.survivors is not None and self.processes.rejoins:  # what a rank that rejoins must run
                    self.processes.survivors.publish_configuration(self._admission_configuration())
            context = RuleContext(
                bucket_bytes=self.options.bucket_bytes,
                grad_scaler=enabled_grad_scaler(self.precision_plugin),
                any_worker=self.ranks().any,
                overlap_backward=self.sharding is None and backward_may_overlap(self.lightning_module),
                warn=rank_zero_warn,
            )
            assert self._replica is not None and self._mixer is not None
            self.driver.build_rule(self._replica, self._mixer, self.optimizers, context)

    def _check_clipping(self, trainer: Trainer) -> None:
        """Sharded replicas surviving failures: refuse clipping by norm, whose norm DTensor reduces on the device
        mesh's groups by name, which are gone once the survivors regroup
        ([`Sharding.regroup`][lightning_decentral.sharding.Sharding.regroup])."""
        norm = trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value"
        if self.sharding is not None and self.options.on_peer_failure == "continue" and norm:
            raise ValueError(
                f"gradient_clip_val={trainer.gradient_clip_val} clips by the norm of the sharded gradients, which "
                "DTensor sums on the device mesh's process groups; with shard_size > 1 and on_peer_failure='continue' "
                "those are gone once the survivors of a failure regroup. Clip by value "
                "(gradient_clip_algorithm='value'), or use on_peer_failure='stop'."
            )

    @override
    def setup_distributed(self) -> None:
        """Runs first in every Trainer run: join the default process group, or make it on this generation's
        namespace of the job's store ([`rendezvous.connect`][lightning_decentral.rendezvous.connect]), so that
        workers torchrun restarts never meet the keys of the workers they replace."""
        if dist.is_available() and dist.is_initialized():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend = self._get_process_group_backend()
        self.processes.make_default_group(
            self.cluster_environment, backend, self.global_rank, self.world_size, self.root_device
        )

    @override
    def configure_ddp(self) -> None:
        """Runs in `setup` when fitting, before the optimizers exist: start every replica from rank 0's
        weights (or from its own shard when resuming), pack it into flat buffers (no DDP wrapper) and
        build the gossip engine. A lost rank started again only packs its replica: it has no process group until it
        rejoins, once its optimizers exist (`setup`)."""
        if self.sharding is not None:  # FSDP's parameters are replaced by views of the flat buffers: before the rest
            self._replica = self.sharding.replica(self.lightning_module, self.gossip_buffers, rank_zero_info)
        if not self.processes.joining:
            self._start_replicas()
        if self.sharding is None:
            self._replica = Replica(self.lightning_module, self.gossip_buffers)
        if not self.processes.joining:
            self._mixer = self.processes.start_gossip(self.root_device, self.launched_by_lightning)

    def _rejoin_the_members(self) -> None:
        """A lost rank started again, its optimizers built: refused, naming the field, unless it runs the members'
        configuration and optimizers (they never see it then); else admitted, it takes its state over from a member
        (paired with the members' collectives after the join: its activities first) and starts its gossip."""
        self.processes.rejoin(self.global_rank, self._process_group_backend, self._admission_configuration())
        joined = self.processes.joined
        assert joined is not None
        self.processes.start_activities()
        precision_key = type(self.precision_plugin).__qualname__
        trainer = self.lightning_module.trainer
        self._resume_shard = take_over_state(trainer, joined, self.first_rank, self.topology, precision_key)
        self._start_saves()
        self._mixer = self.processes.start_gossip(self.root_device, self.launched_by_lightning)

    def _admission_configuration(self) -> dict[str, int | str]:
        """What a rank that rejoins must run as the members do: the fields of their check at set-up, the run's and
        the optimizers' ([`optimizer_configuration`][lightning_decentral.agreement.optimizer_configuration])."""
        fields = self._configuration()
        for stage in optimizer_configuration(self.optimizers):
            fields.update(stage)
        return fields

    # -- one optimizer step -----------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each training batch: begin its optimizer step (AWC posts `x(k)` here)."""
        super().on_train_batch_start(batch, batch_idx)
        self.processes.joining = False
        if batch_idx == 0:
            self._check_replica()
        step = self.lightning_module.trainer.global_step
        if self.processes.activities is not None:
            self.processes.activities.start(f"training batch {batch_idx} (optimizer step {step})")
        self.driver.begin(step)
        if self.processes.survivors is not None:  # on_peer_failure="continue": the workers training, the workers lost
            metrics = self.processes.survivor_metrics(self.world_size)
            self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's `training_step`; `gossip/bytes_sent` (this rank's bytes so far) is logged too. With sharded
        replicas surviving failures, a rank of this replica lost in its forward stops this rank
        ([`in_replica`][lightning_decentral.common.processes.Processes.in_replica])."""
        step = self.lightning_module.trainer.global_step
        output = self.processes.in_replica(
            step, lambda: super(DecentralizedStrategy, self).training_step(*args, **kwargs)
        )
        self.lightning_module.log_dict(self.driver.bytes_metrics(), on_step=True, on_epoch=False)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward; with sharded replicas surviving failures, a rank of this replica lost in it stops this
        rank ([`in_replica`][lightning_decentral.common.processes.Processes.in_replica])."""
        step = self.lightning_module.trainer.global_step
        return self.processes.in_replica(
            step, lambda: super(DecentralizedStrategy, self).backward(closure_loss, optimizer, *args, **kwargs)
        )

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before each backward pass (DecentLaM: gradients go into flat buffers)."""
        super().pre_backward(closure_loss)
        self.driver.begin(self.lightning_module.trainer.global_step).before_backward()

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Around the backward of accumulated micro-batches (DecentLaM posts no bucket there)."""
        with self.driver.begin(self.lightning_module.trainer.global_step).no_backward_sync():
            yield

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs once per optimizer step, in place of `optimizer.step(closure)`: the closure and `U` with
        the rule's exchange around them, then `end_step` and `finish_step` (a step is begun here unless the
        batch start began it: manual optimization may skip it)."""
        step = super().optimizer_step
        return self.driver.optimizer_step(
            self.lightning_module.trainer.global_step,
            lambda wrapped: step(optimizer, wrapped, model, **kwargs),
            closure,
        )

    @override
    def on_train_start(self) -> None:
        """Before the first training batch, once a resume restored everything: with compression, both ends of every
        edge hold the same public copies
        ([`check_same_public_copies`][lightning_decentral.agreement.Ranks.check_same_public_copies])."""
        super().on_train_start()
        if self.options.compression is not None:
            self.ranks().check_same_public_copies(self.driver.copies.state())

    @override
    def on_train_end(self) -> None:
        """After the last training batch: finish anything still in flight."""
        self.driver.drain()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        """After the stage: after a clean fit, leave the gossip groups together (the survivors of a failure first make
        theirs); release the rule's hooks."""
        self.processes.end_gossip(self._mixer, self.lightning_module.trainer.global_step, self._failed)
        self.driver.teardown()
        self._mixer = None  # and its receive buffers
        self._stops = None
        super().teardown()

    def _agree_on_stops(self, trainer: Trainer) -> None:
        """A SIGTERM stops every rank at one step agreed through the store, not through a broadcast per batch."""
        self._stops = StopAgreement(job_store(), next_key(), self._stop_margin(), self._timeout)
        if self.global_rank == 0 and not self.processes.joining:
            self._stops.forget_earlier_runs()
        stop_together(trainer, self._stops, self._check_replica)

    def _stop_margin(self) -> int:
        """The stop margin of the current graph (a join step is as far ahead as a stop step)."""
        return stop_margin(self.topology, self.staleness, self.gossip_every)

    def _handover_state(self) -> dict[str, Any]:
        """What this member hands to a rank that rejoins when it is the source
        ([`handover_state`][lightning_decentral.trainer.rejoin.handover_state]): its shard without the optimizer's
        state, which the loops' restore takes from the handover."""
        parts = self._shard_parts({"optimizer_states": None})
        shard = shards.make_shard(0, self.global_rank, self.world_size, **parts)
        return handover_state(self.lightning_module.trainer, shard)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier; a rank that rejoins runs none before its first batch (the members are training)."""
        if not self.processes.joining:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; a rank that rejoins keeps its own `obj` before its first batch."""
        return obj if self.processes.joining else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Lightning's reduce; a rank that rejoins keeps its own value before its first batch (the length of its data
        Lightning checks)."""
        return tensor if self.processes.joining else super().reduce(tensor, group, reduce_op)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """After the callbacks' `on_exception` (the checkpoint saved at a stop): a SIGTERM stop logs one line on rank 0,
        naming the step and the checkpoint to resume from
        ([`stop_line`][lightning_decentral.trainer.signals.stop_line])."""
        super().on_exception(exception)
        if isinstance(exception, SIGTERMException) and self.is_global_zero:
            log.info(stop_line(self.lightning_module.trainer.global_step, self.last_save))

    def _on_survivors(self, decision: Decision) -> None:
        """After a failure, in the survivors' process group (every survivor together), after what `Processes` does: a
        SIGTERM stops them at one step of their own graph (its diameter may be longer: the stop margin follows)."""
        if self._stops is not None:
            self._stops.margin = self._stop_margin()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Runs when a checkpoint is saved, on every rank, first: `x̄`'s state dict (`ReplicaStrategy`'s); in the steps
        the survivors of a failure take alone, once they made their process group
        ([`form_for_save`][lightning_decentral.membership.form_for_save])."""
        form_for_save(self.processes.survivors)
        state = super().lightning_module_state_dict()
        return self.sharding.full_tensors(state) if self.sharding is not None else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Runs when a checkpoint is saved, on every rank: the optimizer state averaged over the replicas
        (`ReplicaStrategy`'s); with sharded replicas gathered whole, as the checkpoint file holds it."""
        state = super().optimizer_state(optimizer)
        return self.sharding.full_tensors(state) if self.sharding is not None else state

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Runs when a run starts from `ckpt_path` (`ReplicaStrategy`'s); a fit with sharded replicas resumes only from
        its own shards, saved under the same `shard_size` and world size (their shards are the module's). On a rank
        that rejoins (the same command as the members'): read the file alone, no agreement with the members (theirs is
        past); the state handed over replaces what it restores."""
        if self.processes.joining:
            return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            check_same_sharding(self.options.shard_size, self.resuming_shard, checkpoint_path)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Runs when a checkpoint is restored: with sharded replicas, a shard's local tensors become the module's
        shards (the module sharded first, if `configure_model` left it whole)."""
        if self.sharding is not None and self.resuming_shard is not None:
            checkpoint = {
                **checkpoint,
                "state_dict": self.sharding.sharded_state(
                    self.lightning_module, checkpoint["state_dict"], rank_zero_info
                ),
            }
        super().load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Runs when a checkpoint is restored, last: with sharded replicas, a shard's optimizer state becomes that of
        the module's shards."""
        if self.sharding is not None and self.resuming_shard is not None and "optimizer_states" in checkpoint:
            states = [sharded_optimizer_state(o, s) for o, s in zip(self.optimizers, checkpoint["optimizer_states"])]
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def _shard_parts(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of `checkpoint` (`ReplicaStrategy`'s); with sharded replicas, its local shards."""
        parts = super()._shard_parts(checkpoint)
        return local_tensors(parts) if self.sharding is not None else parts

    def _check_replica(self) -> None:
        """At an epoch's first batch: the trainable parameters are still those packed when fit started."""
        assert self._replica is not None, "the replicas are packed when fit starts"
        self._replica.check_trainable_unchanged(self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Runs when a checkpoint is saved, on every rank (see `ReplicaStrategy.save_checkpoint`), as one operation of
        the guard. A failure survived during the save (here, or in the averages before it) leaves every survivor in
        it, alone: they make their group, average `x̄` and the optimizer state again among them, and save."""
        save = super().save_checkpoint

        def among_the_survivors() -> None:
            if self.driver.alone:  # a failure was survived since this save began
                form_for_save(self.processes.survivors)
                checkpoint["state_dict"] = self.lightning_module_state_dict()
                if "optimizer_states" in checkpoint:
                    checkpoint["optimizer_states"] = [self.optimizer_state(o) for o in self.optimizers]
            save(checkpoint, filepath, storage_options)

        self.guard.operation(among_the_survivors)

    def _configuration(self) -> dict[str, int | str]:
        precision = str(getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__))
        configuration = run_configuration(self, self.lightning_module, precision)
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:  # a rank that stops first leaves the others waiting for it
            configuration["max_steps"] = trainer.max_steps
            configuration["max_epochs"] = -1 if trainer.max_epochs is None else trainer.max_epochs
            configuration["rejoin"] = int(
                self.processes.rejoins
            )  # a member without it would never admit a rank that asks
        return configuration

    def _epoch(self) -> int:
        """The Trainer's current epoch: what a `gossip_steps` schedule by epoch reads (restored on resume)."""
        return self.lightning_module.trainer.current_epoch

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register `"dpsgd"`, `"decentlam"` and their `"_spawn"` and `"_fork"` variants."""
        register_strategies(strategy_registry, cls)
