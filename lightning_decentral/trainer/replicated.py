"""`ReplicaStrategy`: Lightning's DDP machinery for runs in which every rank keeps its own replica.

What a decentralized run needs of Lightning besides its update rule, and nothing of gossip:
replicas that start from rank 0's weights (or from their own shard on resume) and are never
wrapped in `DistributedDataParallel`; validation, test and predict on the average `x̄`
(`eval_on="average"`); checkpoints that hold `x̄` and the averaged optimizer state, with one shard
per replica beside them for an exact resume ([`checkpoint`][lightning_decentral.checkpoint]), saved in the
background under Lightning's `AsyncCheckpointIO` ([`background`][lightning_decentral.trainer.background]); and a
check, before anything runs, that every rank runs the same configuration.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_decentral import checkpoint as shards
from lightning_decentral._compat.lightning import MultiProcessingLauncher, SubprocessScriptLauncher
from lightning_decentral.agreement import Ranks, mean_optimizer_state
from lightning_decentral.common import EvaluationOnAverage, Processes, ShardedCheckpoints
from lightning_decentral.common.evaluation import restore_replicas, swap_in_average
from lightning_decentral.driver import StepDriver
from lightning_decentral.files import StrPath, with_atomic_writes
from lightning_decentral.membership.guard import Guard, from_its_value_now
from lightning_decentral.replicas import AveragedModel, MeanFn, local_tensor, state_tensors
from lightning_decentral.trainer.background import BackgroundWriter, background_save
from lightning_decentral.trainer.resume import RESUME, ResolvesLast, ScriptLauncher, choose_checkpoint
from lightning_decentral.trainer.reuse import StepSaves


class ReplicaStrategy(DDPStrategy):
    """`DDPStrategy` without the wrapper and the gradient all-reduce: each rank trains its own replica.

    Subclasses define the update (`optimizer_step`) and `_configuration()`, the fields every rank must agree on; they
    call `_start_replicas()` from `configure_ddp`.

    Args:
        driver: the update rule's driver: the shards record its rule and hold its registered state
            ([`StateRegistry`][lightning_decentral.checkpoint.StateRegistry]); every collective goes through its
            [`Guard`][lightning_decentral.membership.guard.Guard].
        processes: this rank's process group, survivors and activities
            ([`Processes`][lightning_decentral.common.Processes]): its rank and world size follow the survivors of a
            failure.
        resume: `"checkpoint"`: `fit(ckpt_path=...)` resumes from the checkpoint it names; `"newest_complete"`: from
            it if it is complete, else from the newest complete checkpoint in its directory, with one warning
            ([`choose_checkpoint`][lightning_decentral.trainer.resume.choose_checkpoint]).
        **kwargs: `lightning.pytorch.strategies.DDPStrategy`'s arguments.
    """

    def __init__(self, driver: StepDriver, processes: Processes, resume: str = "checkpoint", **kwargs: Any) -> None:
        if resume not in RESUME:
            raise ValueError(f"resume={resume!r} is not one of {RESUME}.")
        self.driver = driver
        self.processes = processes
        self.checkpoints = ShardedCheckpoints(driver, self.ranks)
        super().__init__(**kwargs)
        self.resume = resume
        self._averaged = AveragedModel()
        self.evaluation = EvaluationOnAverage(driver.options.eval_on, self.averaged_model)
        self._resume_shard: dict[str, Any] | None = None  # fit(ckpt_path=...): this rank's shard, until restored
        self._failed = False  # an exception ended the run: no collective at teardown
        self.last_save: tuple[int, str] | None = None  # (step, path) of the last checkpoint saved (a stop names it)
        self._checkpoint_agreed = False  # this fit's ranks checked they resume from the same checkpoint
        self._writer: BackgroundWriter | None = None  # saves in the background (AsyncCheckpointIO), during fit
        self._writer_ranks: Ranks | None = None  # the ranks on the writer's own gloo group
        self._writer_step = -1  # the step of the last save given to the writer
        self._step_saves: StepSaves | None = None  # during fit: what the saves of one step share

    @property
    def guard(self) -> Guard:
        """The path every collective of this rank goes through besides the exchange
        ([`Guard`][lightning_decentral.membership.guard.Guard]): with `on_peer_failure="continue"`, a failure in any
        of them is survived (a checkpoint save then starts again among the survivors: see `save_checkpoint`)."""
        return self.driver.guard

    @property
    @override
    def global_rank(self) -> int:
        """This rank's rank; after a failure, among the survivors (in the order of their first ranks)."""
        return self.processes.rank(super().global_rank)

    @property
    @override
    def world_size(self) -> int:
        """The number of ranks; after a failure, of survivors."""
        return self.processes.world_size(super().world_size)

    @override
    def setup_environment(self) -> None:
        """Runs first in every Trainer run: the ranks have not yet agreed on a checkpoint to resume from."""
        super().setup_environment()
        self._checkpoint_agreed = False

    def _agree_on_checkpoint(self, ckpt_path: StrPath | None) -> None:
        """Every rank's first collective of a fit: stop every rank, naming `ckpt_path`, unless all resume from
        the same checkpoint or none. Lightning calls `load_checkpoint` only on the ranks given a path, so a rank
        with a path runs this from there and a rank without from `configure_ddp`: the two gathers pair up."""
        if not self._checkpoint_agreed:
            self._checkpoint_agreed = True
            self.ranks().check_same_checkpoint(None if ckpt_path is None else shards.comparable(ckpt_path))

    @contextlib.contextmanager
    def averaged_model(self) -> Iterator[None]:
        """Replace this rank's replica by `x̄ = (1/n) Σ_i x_i` inside the block, then restore it.

        Parameters and floating-point buffers are averaged with one all-reduce per
        (device, dtype); a nested use is free. Every rank must enter it together.
        """
        with self._averaged.swapped_in(
            self.lightning_module, self._mean("Averaging the replicas into x̄ (to evaluate)")
        ):
            yield

    def _mean(self, what: str, label: str | None = None) -> MeanFn | None:
        """The mean over the ranks (`Ranks.mean`, naming `what` if a rank fails meanwhile); `None` on one rank. With
        a `label`, during fit, one that the saves of a step share
        ([`ReusedMeans`][lightning_decentral.trainer.reuse.ReusedMeans])."""
        if self.world_size == 1 or self.lightning_module is None:
            return None
        ranks = self.replica_ranks
        if label is not None and self._step_saves is not None:
            return self._step_saves.means.bound(ranks, label, what)
        return functools.partial(ranks.mean, what=what)

    @override
    def _configure_launcher(self) -> None:
        """Runs when the Trainer is built: a spawn or fork launcher hands back `x̄`, not rank 0's replica; every
        launcher gives Lightning a dangling `last.ckpt` link for `fit(ckpt_path="last")`
        ([`ResolvesLast`][lightning_decentral.trainer.resume.ResolvesLast])."""
        super()._configure_launcher()
        if isinstance(self._launcher, MultiProcessingLauncher):
            self._launcher = _AveragingLauncher(self, start_method=self._start_method)
        elif isinstance(self._launcher, SubprocessScriptLauncher):
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Runs before fit, validate, test or predict; outside fit every replica stays as it is."""
        if trainer.state.fn == TrainerFn.FITTING:
            if isinstance(self.checkpoint_io, AsyncCheckpointIO) and any(
                getattr(callback, "save_last", None) == "link" for callback in trainer.checkpoint_callbacks
            ):
                raise ValueError(
                    "ModelCheckpoint(save_last='link') does not go with saves in the background (AsyncCheckpointIO): "
                    "Lightning links last.ckpt to a checkpoint still being written, so a failure meanwhile leaves a "
                    "link to no file, which fit(ckpt_path='last') does not find (a restarted job would start from "
                    "step 0). Use save_last=True with AsyncCheckpointIO, or save_last='link' with synchronous saves "
                    "(drop the AsyncCheckpointIO plugin)."
                )
            super().setup(trainer)  # calls configure_ddp, then builds the optimizers
            return
        # DDPStrategy would broadcast rank 0's weights here: keep every replica as it is.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.ranks().check_same_configuration(self._configuration())
        self.processes.start_activities()
        self.setup_precision_plugin()

    def _start_replicas(self) -> None:
        """Check the checkpoint and the configuration on every rank; start every replica from rank 0's weights
        unless resuming."""
        self._agree_on_checkpoint(None)  # a no-op on ranks that already agreed in load_checkpoint
        self.ranks().check_same_configuration(self._configuration())
        self.processes.start_activities()
        if self._resume_shard is None:
            self.replica_ranks.broadcast_from_rank_zero([local_tensor(t) for t in state_tensors(self.lightning_module)])
        self._start_saves()

    def _start_saves(self) -> None:
        """The end of `_start_replicas`: what the saves of this fit need."""
        self._failed = False
        if isinstance(self.checkpoint_io, AsyncCheckpointIO):
            group = dist.new_group(backend="gloo", timeout=self._timeout)
            self._writer_ranks = Ranks(self.global_rank, self.world_size, torch.device("cpu"), group)
            self._writer = BackgroundWriter()
        self._step_saves = StepSaves(None if self._writer is None else self._writer.submit)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Runs before each training batch: forget what the saves of the step before shared (the replicas change)."""
        if self._step_saves is not None:
            self._step_saves.forget()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_validation_start(self) -> None:
        """Runs when validation starts: forget what the saves of the step shared (no memory held meanwhile); swap in
        `x̄` (`eval_on="average"`)."""
        if self._step_saves is not None:
            self._step_saves.forget()
        swap_in_average(self)

    # -- validation, test and predict on x̄ (eval_on="average"), every replica restored afterwards ------------------

    on_test_start = on_predict_start = swap_in_average
    on_validation_end = on_test_end = on_predict_end = restore_replicas

    @override
    def on_train_end(self) -> None:
        """Runs when training ends: wait until every checkpoint saved in the background is on disk (raising a
        save's error here, on every rank)."""
        if self._writer is not None:
            self._writer.wait()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Runs when a run stops with an error: no collective may run at teardown."""
        self._failed = True
        self.evaluation.end()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Runs after each stage: forget a shard not restored; let the background writer end (after an error
        without waiting: a save may wait on a dead peer), and save synchronously from now on."""
        self._resume_shard = None
        self._step_saves = None
        if self._writer is not None:
            self._writer.close(wait=not self._failed)
            if not self._failed:
                dist.destroy_process_group(self._writer_ranks.group)
            self._writer = self._writer_ranks = None
        super().teardown()

    # -- Lightning's own collectives go through the guard: a rank that fails meanwhile raises the library's error,
    # -- or, with survivors, the collective completes among them -------------------------------------------------

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier, through the guard."""
        self._lightning_collective("barrier", functools.partial(super().barrier, *args, **kwargs))

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Lightning's broadcast, through the guard."""
        return self._lightning_collective("broadcast", functools.partial(super().broadcast, obj, src))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Lightning's reduce (`self.log(..., sync_dist=True)`), through the guard (each try from `tensor`'s value)."""
        reduce = from_its_value_now(tensor, functools.partial(super().reduce, tensor, group, reduce_op))
        return self._lightning_collective("reduce (a metric logged with sync_dist=True?)", reduce)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Lightning's all-gather, through the guard."""
        return self._lightning_collective(
            "all_gather", functools.partial(super().all_gather, tensor, group, sync_grads)
        )

    def _lightning_collective(self, name: str, collective: Callable[[], Any]) -> Any:
        when = ""
        if self.lightning_module is not None:
            with contextlib.suppress(RuntimeError):  # not attached to a Trainer
                trainer = self.lightning_module.trainer
                when = f" at step {trainer.global_step} ({trainer.state.stage})"
        return self.guard.run(f"Lightning's {name}{when}", collective)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Runs when a checkpoint is saved, on every rank: the optimizer state averaged over ranks, so that
        a resumed run starts from the mean momentum (when saving in the background, the background thread averages
        it: this rank's own state here).

        For DecentLaM this also cancels each rank's consensus term: `1ᵀ (I − W) = 0`.
        """
        if self._writer is not None:
            return super().optimizer_state(optimizer)
        label = next((f"optimizer {i}" for i, known in enumerate(self.optimizers) if known is optimizer), None)
        mean = self._mean("Averaging the optimizer state (to save)", label)
        return mean_optimizer_state(self.replica_ranks, super().optimizer_state(optimizer), mean)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Runs when a checkpoint is saved, on every rank, first: `x̄`'s state dict, so any rank's checkpoint loads
        into a plain module (when saving in the background, the background thread averages it: this rank's own
        replica here). A rank that saves alone (`if trainer.is_global_zero: trainer.save_checkpoint(...)`) stops at
        once, naming what the others do."""
        self._finish_earlier_saves()
        if self.processes.activities is not None:
            self.processes.activities.agree("a checkpoint save (trainer.save_checkpoint or a checkpoint callback)")
        if self._writer is not None:
            return self._averaged.own_state_dict(self.lightning_module)
        return self._averaged.state_dict(
            self.lightning_module, self._mean("Averaging the replicas into x̄ (to save)", "x̄")
        )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any | None = None
    ) -> None:
        """Runs when a checkpoint is saved, on every rank: each writes its shard, then rank 0 the checkpoint
        file ([`save_with_shards`][lightning_decentral.checkpoint.save_with_shards]), atomically unless a
        `CheckpointIO` of your own writes it ([`with_atomic_writes`][lightning_decentral.files.with_atomic_writes]).
        Under `AsyncCheckpointIO`, in the background after a copy; the first save of a step waits for those of earlier
        steps (so at most one step's saves are in flight, and a failed one raises at the same save on every rank)."""
        self.last_save = (self.lightning_module.trainer.global_step, str(filepath))
        if self._writer is not None:
            self._finish_earlier_saves()
            write_file = functools.partial(self._write_file, filepath=filepath, storage_options=storage_options)
            own = self._shard_parts(checkpoint)
            self._writer.submit(
                background_save(checkpoint, filepath, own, self._writer_ranks, self._step_saves, write_file)
            )
            return
        self.checkpoints.save(
            checkpoint,
            filepath,
            self._shard_parts(checkpoint),
            write_file=lambda: self._write_file(checkpoint, filepath, storage_options),
            earlier=None if self._step_saves is None else self._step_saves.shards,
        )

    def _finish_earlier_saves(self) -> None:
        """Under `AsyncCheckpointIO`, at the first save of a step: wait until the saves of earlier steps are done. A
        failed one raises here, on every rank, before this save agrees on anything (a rank that raised first could
        otherwise leave the job, with the store it hosts, while another still agreed: a `PeerFailure` instead of
        the save's error)."""
        if self._writer is None:
            return
        step = self.lightning_module.trainer.global_step
        if step != self._writer_step:
            self._writer.wait()
            self._writer_step = step

    def _write_file(self, checkpoint: dict[str, Any], filepath: StrPath, storage_options: Any) -> None:
        """Rank 0 writes the checkpoint file now (with `AsyncCheckpointIO`, through the plugin it wraps: the file
        must be written after the shards, and only then may the ranks agree it was)."""
        if self.is_global_zero:
            with_atomic_writes(self._file_io).save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @property
    def _file_io(self) -> CheckpointIO:
        io = self.checkpoint_io
        return io.checkpoint_io if isinstance(io, AsyncCheckpointIO) else io

    @override
    def remove_checkpoint(self, filepath: StrPath) -> None:
        """Runs when a checkpoint callback drops an old checkpoint: rank 0 removes the checkpoint file, every
        rank its own shards of it (under `AsyncCheckpointIO`, in the background once the saves before are done)."""
        if self._writer is not None:
            self._writer.submit(lambda: self._remove_now(filepath))
            return
        self._remove_now(filepath)

    def _remove_now(self, filepath: StrPath) -> None:
        if self.is_global_zero:
            self._file_io.remove_checkpoint(filepath)
        shards.remove_shards(filepath, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: StrPath, weights_only: bool | None = None) -> dict[str, Any]:
        """Runs when a run starts from `ckpt_path`: read the checkpoint file (`weights_only=True` unless the
        caller asks otherwise); when fitting, also this rank's shard (with `resume="newest_complete"`, of the
        checkpoint [`choose_checkpoint`][lightning_decentral.trainer.resume.choose_checkpoint] picks).

        If every rank finds its shard of the same save at the same world size, the checkpoint returned carries
        this rank's replica, optimizer and precision-plugin state, and `configure_ddp` keeps the replicas as
        they are (exact resume). Otherwise every replica restarts from `x̄` with the averaged optimizer state,
        and rank 0 warns once, saying why.
        """
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._agree_on_checkpoint(checkpoint_path)
            if self.resume == "newest_complete":
                checkpoint_path = choose_checkpoint(self.ranks(), checkpoint_path, rank_zero_warn)
        checkpoint = super().load_checkpoint(
            checkpoint_path, weights_only=True if weights_only is None else weights_only
        )
        if not fitting:
            return checkpoint
        shard = self.checkpoints.read(checkpoint_path, checkpoint.get(shards.META_KEY))
        if shard is None:
            return checkpoint
        self._resume_shard = shard
        return shards.with_shard(checkpoint, shard, precision_key=type(self.precision_plugin).__qualname__)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Runs when a checkpoint is restored, last (Lightning restores the optimizers after the model
        and the loops): the optimizers, then, if resuming from shards, this rank's step (checked) and every part
        its driver registered, the random state among them
        (after this, nothing draws a random number before the training loop makes its iterator)."""
        super().load_optimizer_state_dict(checkpoint)
        shard, self._resume_shard = self._resume_shard, None
        if shard is not None:
            self.checkpoints.restore(shard, self.lightning_module.trainer.global_step)

    def _shard_parts(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of `checkpoint`, its shard but the save id
        ([`shard_contents`][lightning_decentral.driver.StepDriver.shard_contents]): its own replica, optimizer,
        precision-plugin, step and every registered part (the random state among them; live: not copied)."""
        weights_only = "optimizer_states" not in checkpoint
        return self.driver.shard_contents(
            0,
            state_dict=self._averaged.own_state_dict(self.lightning_module),
            step=self.lightning_module.trainer.global_step,
            optimizer_states=None if weights_only else [o.state_dict() for o in self.optimizers],
            precision=None if weights_only else self.precision_plugin.state_dict(),
        )

    # -- every rank runs the same configuration ----------------------------------------------

    def ranks(self) -> Ranks:
        """This rank's collectives over the current world (the survivors' after a failure), on its device, through
        the guard."""
        return Ranks.of_world(self.root_device, self.guard)

    @property
    def resuming_shard(self) -> dict[str, Any] | None:
        """During `fit(ckpt_path=...)`, from `load_checkpoint` until the optimizers are restored: this rank's shard,
        if the run resumes exactly from the shards (`None` otherwise)."""
        return self._resume_shard

    @property
    def replica_ranks(self) -> Ranks:
        """The ranks a mean over the replicas runs on (every rank; a subclass with sharded replicas: this rank's
        column)."""
        return self.ranks()

    def _configuration(self) -> dict[str, int | str]:
        """What every rank must agree on (`Ranks.check_same_configuration`)."""
        raise NotImplementedError


class _AveragingLauncher(ResolvesLast, MultiProcessingLauncher):
    """Spawn/fork launcher that hands `x̄`, not rank 0's replica, back to the main process (and resolves a `last.ckpt`
    link whose file is gone: `ResolvesLast`)."""

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        assert isinstance(self._strategy, ReplicaStrategy)
        with self._strategy.averaged_model():
            return super()._collect_rank_zero_results(trainer, results)
