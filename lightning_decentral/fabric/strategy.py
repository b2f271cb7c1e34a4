"""Fabric's `DecentralizedStrategy`: the update rules inside `optimizer.step()` of a hand-written loop (the
package docstring of [`lightning_decentral.fabric`][lightning_decentral.fabric] shows one step)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_decentral import checkpoint as shards
from lightning_decentral._compat.lightning import BackwardSyncControl
from lightning_decentral.agreement import Ranks, mean_optimizer_state, parameter_deviations, run_configuration
from lightning_decentral.common import Processes, ShardedCheckpoints, enabled_grad_scaler, launched_by_lightning
from lightning_decentral.driver import Driven, StepDriver, StepRunner
from lightning_decentral.fabric.checkpoints import STEP_KEY, PrefixedModule, load_every_weight, set_up_first
from lightning_decentral.files import StrPath, with_atomic_writes
from lightning_decentral.measures import own_gradients, random_state
from lightning_decentral.membership import Decision, form_for_save
from lightning_decentral.membership.guard import Guard, from_its_value_now
from lightning_decentral.mixing import FABRIC, Mixer
from lightning_decentral.options import gossip_options, refuse_sharding, register_strategies, takes_gossip_options
from lightning_decentral.replicas import AveragedModel, Replica, state_tensors
from lightning_decentral.rules import RuleContext, check_one_optimizer
from lightning_decentral.timeouts import DEFAULT_TIMEOUT, checked_timeout


@takes_gossip_options
class DecentralizedStrategy(Driven, DDPStrategy):
    """Fabric's decentralized data-parallel strategy: each rank keeps its own replica and gossips it.

    The update rules and their arguments are those of the Trainer's
    [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy] (keyword only, the fields of
    [`GossipOptions`][lightning_decentral.options.GossipOptions], which describes each: `topology`, `combine`,
    `momentum`, `gossip_every`, `gossip_steps`, `gossip_buffers`, `eval_on`, `bucket_cap_mb`, `gossip_dtype`,
    `staleness`, `delays`, `on_peer_failure`, `min_workers`, `outer_optimizer`, `outer_overlap`, `compression`,
    `consensus_step`, `compression_overlap`, `shard_size`; `rejoin=True` and `shard_size` above 1 are the Trainer's
    only); the others (`accelerator`, `parallel_devices`, `cluster_environment`, `checkpoint_io`, `precision`,
    `process_group_backend`, `timeout`, `start_method`) are
    `lightning.fabric.strategies.DDPStrategy`'s (`timeout`, 5 minutes unless given, bounds every exchange: a dead or
    silent rank ends the others within it, and ranks that call different collectives, `fabric.load` on one and a step on
    another, stop at once); any other name is a `TypeError`. `eval_on` decides what
    [`evaluation`][lightning_decentral.fabric.DecentralizedStrategy.evaluation] swaps in.

    A `gossip_steps` schedule by epoch (`{"epoch": {...}}`) reads the epoch the loop gives
    [`set_epoch`][lightning_decentral.fabric.DecentralizedStrategy.set_epoch] (Fabric has no epochs of its own).

    One model and one optimizer per strategy. DecentLaM sends its buckets during backward from the
    second step on, unless the first step called `fabric.clip_gradients` (then it sends them in
    `optimizer.step()`, after the clipping, on every step).

    Examples:
        ```python
        import lightning_decentral  # registers "dpsgd", "decentlam" and their "_spawn" variants
        fabric = Fabric(strategy="decentlam", accelerator="cpu", devices=4)
        fabric = Fabric(strategy=DecentralizedStrategy(topology="one_peer_exponential"), devices=8)
        ```
    """

    strategy_name = "dpsgd"

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **options: Any,
    ) -> None:
        if options.pop("rejoin", False):
            raise ValueError(
                "rejoin=True is supported by the Trainer's DecentralizedStrategy only: a rank that rejoins resumes "
                "Lightning's loops from a member's state, and a Fabric loop is yours. Under Fabric a lost rank stays "
                "out (on_peer_failure='continue'); resume from a checkpoint to grow."
            )
        gossip = gossip_options(type(self).__name__, **options)
        refuse_sharding(
            gossip,
            "Fabric's DecentralizedStrategy",
            "its module is set up by fabric.setup, which has no device mesh yet",
        )
        self.driver = StepDriver(
            gossip, epoch=self._epoch, phrasing=FABRIC
        )  # bound to the world size with the launcher
        self.processes = Processes(self.driver, checked_timeout(timeout), ranks=self.ranks)
        self.checkpoints = ShardedCheckpoints(self.driver, self.ranks)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=self.processes.timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _RuleBackwardSync(self._begin_step)
        self.step = 0  # k: the optimizer steps taken (saved with every checkpoint)
        self.epoch: int | None = None  # the loop's epoch, for a gossip_steps schedule by epoch (set_epoch)
        self._module: Module | None = None
        self._optimizer: Optimizer | None = None
        self._replica: Replica | None = None
        self._mixer: Mixer | None = None
        self._context = RuleContext(overlap_backward=False)  # DecentLaM: learnt on the first step
        self._clipping = False  # fabric.clip_gradients ran
        self._averaged = AveragedModel()
        self._averaging = 0  # depth of averaged_model()
        self._hooks: list[Any] = []
        self._forward_states: list[dict[str, Any]] = []  # the random state of each training forward of step k
        self._graph_pending = False  # a training forward ran and its backward has not: the parameters are in use

    # -- the monitoring surface (Driven's, and these) ---------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Tell the strategy the loop's epoch, at the start of every epoch (from the epoch a resumed loop restored):
        required with a `gossip_steps` schedule by epoch, ignored otherwise."""
        self.epoch = epoch

    @property
    def module(self) -> Module:
        """The set-up module (this rank's replica); an error before `fabric.setup`."""
        return set_up_first(self._module)

    @property
    def trained_module(self) -> Module:
        """The set-up module (this rank's replica); an error before `fabric.setup`."""
        return self.module

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `‖p_i − p̄‖²` on this rank and `‖p̄‖²` (0-dim float64, `p̄`
        averaged in at least float32; one all-reduce: every rank calls it together)."""
        return parameter_deviations(self.ranks(), self.trained_module)

    def gradient_sum(self) -> list[Tensor]:
        """This rank's gradient of each trainable parameter (zeros where it has none)."""
        return own_gradients(self.trained_module)

    @property
    def guard(self) -> Guard:
        """The path every collective of this rank goes through besides the exchange
        ([`Guard`][lightning_decentral.membership.guard.Guard]): with `on_peer_failure="continue"`, a failure in any
        of them is survived (`fabric.save` then starts again among the survivors)."""
        return self.driver.guard

    def ranks(self) -> Ranks:
        """This rank's collectives over the current world (the survivors' after a failure), on its device, through
        the guard."""
        return Ranks.of_world(self.root_device, self.guard)

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

    @property
    def first_rank(self) -> int:
        """This rank's global rank when the run started (a failure renumbers the survivors)."""
        return self.processes.first_rank(self.global_rank)

    @property
    def failures_survived(self) -> list[Decision]:
        """The survivors' decisions of the run so far (or of the last one), one per failure survived."""
        return self.processes.failures_survived

    @property
    def start_method(self) -> str:
        """How Lightning's launcher starts the ranks: `start_method=`, or the registered name's (`"dpsgd_spawn"`:
        `"spawn"`); `"popen"` runs the script once per rank."""
        return self._start_method

    @property
    def launched_by_lightning(self) -> bool:
        """Whether Lightning's own launcher started this rank
        ([`launched_by_lightning`][lightning_decentral.common.launched_by_lightning])."""
        return launched_by_lightning(self.start_method, self.launcher, self.cluster_environment)

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The enabled GradScaler of fp16 mixed precision, once set up; else `None`."""
        return self._context.grad_scaler

    def record_random_state(self) -> None:
        """Record the random state a training forward starts from (the CPU generator's and, on a GPU, this
        rank's device's). The forward pre-hook calls it at every training forward of the current optimizer
        step; the list starts empty at each step's first training forward.
        [`effective_lr_metrics`][lightning_decentral.fabric.effective_lr_metrics] replays these states, so the
        gradients at `x̄` see the dropout masks the training forwards drew."""
        self._forward_states.append(random_state(self.root_device))

    @property
    def forward_random_states(self) -> list[dict[str, Any]]:
        """The random states recorded by `record_random_state` in the current step, in order (a copy):
        `{"cpu": ByteTensor}`, plus `"cuda": (device, ByteTensor)` on a GPU."""
        return list(self._forward_states)

    @contextlib.contextmanager
    def averaged_model(self, agree: bool = True) -> Iterator[None]:
        """Replace this rank's replica by `x̄ = (1/n) Σ_i x_i` inside the block, then restore it exactly.

        Every rank must enter it together, between optimizer steps (or after `fabric.backward`); a nested use is
        free. Between a training forward and its backward it raises: the backward needs the replica's values. With
        `agree`, a rank that does something else meanwhile stops every rank at once, naming it
        ([`agree`][lightning_decentral.fabric.DecentralizedStrategy.agree]); `fabric.save`, which agreed already,
        averages without.
        """
        module = set_up_first(self._module)
        if not self._averaging:
            self.check_outside_the_graph("averaged_model()")
            if agree and self.world_size > 1:
                self.agree("averaged_model()")
        self._averaging += 1
        try:
            with self._averaged.swapped_in(module, self.ranks().mean if self.world_size > 1 else None):
                yield
        finally:
            self._averaging -= 1

    def evaluation(self) -> AbstractContextManager:
        """[`averaged_model()`][lightning_decentral.fabric.DecentralizedStrategy.averaged_model] with
        `eval_on="average"`; nothing (each rank's own replica) with `eval_on="local"`."""
        return self.averaged_model() if self.eval_on == "average" else nullcontext()

    # -- set-up -------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        """Runs when Fabric is built, before any process starts: refuse `on_peer_failure="continue"` on a backend it
        does not run on, then bind the topology (a bad one fails here)."""
        self.processes.check_backend(self.process_group_backend, self.root_device)
        super()._configure_launcher()
        self.driver.bind(self.num_nodes * self.num_processes, self.num_nodes, rank_zero_warn)

    @override
    def _setup_distributed(self) -> None:
        """Runs in `fabric.launch()`: make the default process group on this generation's namespace of the job's
        store ([`rendezvous.connect`][lightning_decentral.rendezvous.connect]), so that workers torchrun restarts
        never meet the keys of the workers they replace; join it if it exists."""
        if dist.is_initialized():
            super()._setup_distributed()
            return
        self._set_world_ranks()
        backend = self._process_group_backend = self._get_process_group_backend()
        self.processes.make_default_group(
            self.cluster_environment, backend, self.global_rank, self.world_size, self.root_device
        )

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """Runs in `fabric.setup(model, optimizer)`: the replica, then the update rule."""
        check_one_optimizer(optimizers, "`fabric.setup` got")
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizers[0])], scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        """Runs in `fabric.setup`: check the configuration on every rank, start every replica from rank 0's
        weights, pack it into flat buffers (no DDP wrapper) and build the gossip engine."""
        if isinstance(module, DistributedDataParallel):
            raise ValueError(
                "DecentralizedStrategy trains one replica per rank and never all-reduces gradients: pass the "
                "module itself to `fabric.setup`, not a DistributedDataParallel wrapper (use `ddp.module`)."
            )
        if self._module is not None:
            raise ValueError("DecentralizedStrategy gossips one model: set up one module per Fabric.")
        precision = str(getattr(self.precision, "precision", type(self.precision).__name__))
        self.ranks().check_same_configuration(run_configuration(self, module, precision))
        self.processes.start_activities().start("fabric.setup")
        self.ranks().broadcast_from_rank_zero(list(state_tensors(module)))
        self._replica = Replica(module, self.gossip_buffers)
        self._mixer = self.processes.start_gossip(self.root_device, self.launched_by_lightning)
        self._module = module
        self._hooks = [module.register_forward_pre_hook(self._before_forward)]
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Runs in `fabric.setup` or `fabric.setup_optimizers`: build the update rule around `optimizer`."""
        if self.driver.runner is not None:
            raise ValueError(
                "DecentralizedStrategy needs exactly one optimizer; a second was set up. Put the parameters "
                "into one optimizer with several parameter groups."
            )
        self._context.bucket_bytes = self.options.bucket_bytes
        self._context.grad_scaler = enabled_grad_scaler(self.precision)
        self._context.any_worker = self.ranks().any
        self._context.warn = rank_zero_warn
        self.driver.build_rule(set_up_first(self._replica), set_up_first(self._mixer), [optimizer], self._context)
        self._optimizer = optimizer
        return optimizer

    # -- one optimizer step -------------------------------------------------------------------

    def _before_forward(self, module: Module, args: Any) -> None:
        """Forward pre-hook of the set-up module: a training forward begins the step (AWC posts `x(k)`) and
        records the random state it starts from."""
        if module.training and torch.is_grad_enabled() and not self._averaging:
            self._begin_step()
            self.record_random_state()
            self._graph_pending = True

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Runs in `fabric.backward`: the rule prepares the backward (DecentLaM: flat gradients)."""
        if self.driver.runner is not None:
            self._begin_step().before_backward()
        super().backward(tensor, module, *args, **kwargs)
        self._graph_pending = False

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Runs in `optimizer.step()`: the rule's wait (AWC) or posts (DecentLaM) after the backward that
        already ran, `U`, then `end_step` and `finish_step`; `k` advances."""
        self._begin_step()
        closure = kwargs.pop("closure", None)
        step = super().optimizer_step

        def run(wrapped: Callable[[], Any]) -> Any:
            if closure is None:  # forward and backward ran in the user's loop
                wrapped()
                return step(optimizer, **kwargs)
            return step(optimizer, closure=wrapped, **kwargs)

        output = self.driver.optimizer_step(self.step, run, closure or _nothing)
        self.step += 1
        self._graph_pending = False
        self._context.overlap_backward = not self._clipping
        return output

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Runs in `fabric.clip_gradients(max_norm=...)`."""
        self._before_clipping()
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Runs in `fabric.clip_gradients(clip_val=...)`."""
        self._before_clipping()
        return super().clip_gradients_value(module, optimizer, clip_val)

    def _before_clipping(self) -> None:
        if self._context.overlap_backward and self.rule == "decentlam":
            raise RuntimeError(
                f"fabric.clip_gradients ran at step {self.step}, after DecentLaM had sent buckets of unclipped "
                "gradients during backward. Clip from the first optimizer step on (DecentLaM then sends after "
                "the clipping), or not at all."
            )
        self._clipping = True

    def check_outside_the_graph(self, what: str) -> None:
        """Raise naming `what` (`"fabric.save"`, ...) and where to call it, if a training forward ran and its backward
        has not: `what` would write into, or swap `x̄` into, the parameters the backward pass needs."""
        if self._graph_pending:
            raise RuntimeError(
                f"{what} ran at step {self.step} between the training forward and `fabric.backward`: the backward "
                "needs the parameters as the forward used them. Call fabric.save, fabric.load and averaged_model() "
                "after `fabric.backward` or `optimizer.step()`, before the next training forward."
            )

    def agree(self, what: str) -> None:
        """Right before a collective every rank must enter together: stop at once, naming what each rank does, if
        another rank does something else ([`Activities`][lightning_decentral.agreement.Activities]); a no-op before
        set-up, and in the steps the survivors of a failure take alone (nobody to agree with). Nothing else may be
        agreed or begun before that collective."""
        if self.processes.activities is not None and not self.driver.alone:
            self.processes.activities.agree(what)

    def _begin_step(self) -> StepRunner:
        """The rule, with step `k` begun (once per step: the schedule decides it here)."""
        if not self.driver.begun:
            self._forward_states = []  # a new optimizer step
            if self.processes.activities is not None:
                self.processes.activities.start(f"optimizer step {self.step}")
        return self.driver.begin(self.step)

    def _epoch(self) -> int:
        """The loop's epoch (`set_epoch`); required by a `gossip_steps` schedule by epoch."""
        if self.epoch is None:
            if self.gossip_steps.by_epoch:
                raise RuntimeError(
                    f"gossip_steps={self.gossip_steps} changes with the epoch, which Fabric does not know: call "
                    "`fabric.strategy.set_epoch(epoch)` at the start of every epoch of your loop."
                )
            return 0
        return self.epoch

    # -- fabric.save and fabric.load: x̄ in the file, a shard per rank beside it ------------------------------

    @override
    def save_checkpoint(
        self,
        path: StrPath,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Runs in `fabric.save`, on every rank: the file holds `x̄` and the averaged optimizer state; each
        rank writes its shard beside it, then rank 0 the file
        ([`save_with_shards`][lightning_decentral.checkpoint.save_with_shards]). In the steps the survivors of a failure
        take alone, they make their process group first
        ([`form_for_save`][lightning_decentral.membership.form_for_save])."""
        module_key, optimizer_key = self._keys(state)
        if module_key is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        self.check_outside_the_graph("fabric.save")
        self.guard.operation(
            lambda: self._save_sharded(path, state, storage_options, filter, module_key, optimizer_key)
        )
        return None

    def _save_sharded(
        self,
        path: StrPath,
        state: dict[str, Any],
        storage_options: Any,
        filter: Any,
        module_key: str,
        optimizer_key: str | None,
    ) -> None:
        """`save_checkpoint` with the module at `state[module_key]`: one operation of the guard (a failure survived
        during it starts it again: every survivor is in this save, and they make their group first)."""
        form_for_save(self.processes.survivors)  # in the steps the survivors of a failure take alone: their group first
        self.agree(f"fabric.save({str(path)!r})")
        with self.averaged_model(
            agree=False
        ):  # agreed above: the averaging's all-reduce is the save's first collective
            converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
            converted[module_key] = {
                k: v.clone() if isinstance(v, Tensor) else v for k, v in converted[module_key].items()
            }
        if optimizer_key is not None:
            converted[optimizer_key] = mean_optimizer_state(self.ranks(), converted[optimizer_key])
        converted[STEP_KEY] = self.step

        def write_file() -> None:
            if self.is_global_zero:
                io = with_atomic_writes(self.checkpoint_io)  # unless a CheckpointIO of your own writes it
                io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

        contents = self.driver.shard_contents(
            0,
            state_dict=state[module_key].state_dict(),
            step=self.step,
            optimizer_states=[self._optimizer.state_dict()] if optimizer_key is not None else None,
            precision=self.precision.state_dict(),
        )
        self.checkpoints.save(converted, path, contents, write_file)

    @override
    def load_checkpoint(
        self,
        path: StrPath,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Runs in `fabric.load`, on every rank: restore `x̄` and the averaged optimizer state; then, if every
        rank finds its shard of the same save at the same world size, its own replica, optimizer, precision
        and RNG state (exact resume); else rank 0 warns once, saying why. `k` is restored too.

        The model is found in `state` by identity, or as
        [`under_prefix(model, ...)`][lightning_decentral.fabric.under_prefix]; a checkpoint that holds none of its
        weights is an error naming the keys, before anything is restored."""
        module_key, optimizer_key = self._keys(state) if isinstance(state, dict) else (None, None)
        if module_key is not None:
            self.check_outside_the_graph("fabric.load")
            self.agree(f"fabric.load({str(path)!r})")
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        if module_key is None:
            return remainder
        meta = remainder.pop(shards.META_KEY, None)
        self.step = int(remainder.pop(STEP_KEY, remainder.get("global_step", 0)))
        shard = self.checkpoints.read(path, meta)
        if shard is None:
            return remainder
        target = state[module_key]
        if isinstance(target, PrefixedModule):
            target.load_state_dict(shard["state_dict"], strict=strict)
        else:
            self.load_module_state_dict(target, shard["state_dict"], strict=strict)
        if optimizer_key is not None and "optimizer_states" in shard:
            set_up_first(self._optimizer).load_state_dict(shard["optimizer_states"][0])
        if shard.get("precision"):
            self.precision.load_state_dict(shard["precision"])
        self.checkpoints.restore(shard, self.step, full=optimizer_key is not None)  # the step must be the file's
        if self.driver.options.compression is not None:  # both ends of every edge resume with the same public copies
            self.ranks().check_same_public_copies(self.driver.copies.state() or shard.get("gossip"))
        return remainder

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Runs in `fabric.load` for a module: its state, or an error naming the keys when the checkpoint holds none
        of its weights (`fabric.checkpoints.load_every_weight`)."""
        load_every_weight(module, state_dict, strict)

    def _keys(self, state: dict[str, Any]) -> tuple[str | None, str | None]:
        """The keys under which `state` holds this strategy's module (itself, or under a prefix) and optimizer."""

        def found(target: Any) -> str | None:
            for key, value in state.items():
                if target is not None and (
                    value is target or (isinstance(value, PrefixedModule) and value.module is target)
                ):
                    return key
            return None

        return found(self._module), found(self._optimizer)

    # -- Fabric's collectives go through the guard (with survivors of a failure, they complete among them) -------

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor:
        """`fabric.all_reduce`, through the guard (each try from `tensor`'s value)."""
        reduce = from_its_value_now(tensor, functools.partial(super().all_reduce, tensor, group, reduce_op))
        return self.guard.run(f"Fabric's all_reduce at step {self.step}", reduce)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """`fabric.barrier`, through the guard."""
        self.guard.run(f"Fabric's barrier at step {self.step}", functools.partial(super().barrier, *args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`fabric.broadcast`, through the guard."""
        return self.guard.run(f"Fabric's broadcast at step {self.step}", functools.partial(super().broadcast, obj, src))

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """`fabric.all_gather`, through the guard."""
        gather = functools.partial(super().all_gather, tensor, group, sync_grads)
        return self.guard.run(f"Fabric's all_gather at step {self.step}", gather)

    @override
    def teardown(self) -> None:
        """Runs when the run is over (`fabric.strategy.teardown()`): finish any exchange, leave the gossip group
        together (after a failed step: abort it, the others may be gone) and release the rule's hooks."""
        failed = self.driver.failed
        self.driver.drain()
        self.processes.end_gossip(self._mixer, self.step, failed)
        self.driver.teardown()
        for hook in self._hooks:
            hook.remove()
        self._mixer = self._replica = self._module = self._optimizer = None
        self._hooks = []
        self._forward_states = []
        self._graph_pending = False
        self.processes.activities = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register `"dpsgd"`, `"decentlam"` and their `"_spawn"` variants in Fabric's registry."""
        register_strategies(strategy_registry, cls)


class _RuleBackwardSync(BackwardSyncControl):
    """`fabric.no_backward_sync`: begin the step, then the rule's own context (DecentLaM posts nothing)."""

    def __init__(self, begin_step: Callable[[], StepRunner]) -> None:
        self.begin_step = begin_step

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Runs in `fabric.no_backward_sync(model, enabled)`, around an accumulated micro-batch."""
        if not enabled:
            return nullcontext()
        return self.begin_step().no_backward_sync()


def _nothing() -> None:
    return None
