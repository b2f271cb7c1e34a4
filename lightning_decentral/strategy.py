"""``DecentralizedStrategy``: Lightning's DDP machinery, with gossip instead of all-reduce.

One optimizer step ``k`` on rank ``i``, adapt-with-combine (the default)::

    on_train_batch_start   copy x_i(k) into the send buffers, post the exchange
    closure                forward + backward on the local shard (bytes in flight)
    end of the closure     wait: send buffers <- W(k) x(k) - x_i(k)
    optimizer.step()       x_i <- U(x_i(k), g_i)
    after the step         x_i(k+1) <- x_i + (W(k) x(k) - x_i(k))

adapt-then-combine steps first and then gossips, ``x_i(k+1) = sum_j w_ij U(x_j(k), g_j)``.
Gradients are never all-reduced and the module is never wrapped in
``DistributedDataParallel``; launching, cluster environments, samplers,
``barrier``, ``broadcast`` and ``reduce`` are ``DDPStrategy``'s own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_decentral import algorithms
from lightning_decentral.gossip import Gossip, PendingGossip, pack_
from lightning_decentral.topology import TOPOLOGIES, Topology, resolve_topology

_COMBINE = ("awc", "atc")
_EVAL_ON = ("average", "local")


class DecentralizedStrategy(DDPStrategy):
    """Decentralized data-parallel training: each rank keeps its own replica and gossips it.

    Update rules (``../shared/ALGORITHMS.md`` §1, §2, §4), with ``U`` the user's optimizer:

    * ``combine="awc"``: ``x_i(k+1) = sum_j w_ij(k) x_j(k) + (U(x_i(k), g_i) - x_i(k))``; the
      exchange of ``x(k)`` overlaps the forward and backward pass.
    * ``combine="atc"``: ``x_i(k+1) = sum_j w_ij(k) U(x_j(k), g_j)``.

    Args:
        topology: a name from :data:`~lightning_decentral.topology.TOPOLOGIES` (``"ring"``,
            ``"torus"``, ``"exponential"``, ``"one_peer_exponential"``, ``"complete"``), a
            :class:`~lightning_decentral.topology.Topology`, a mixing matrix or a ``networkx`` graph.
        combine: ``"awc"`` (adapt-with-combine) or ``"atc"`` (adapt-then-combine).
        gossip_every: gossip on steps with ``(k + 1) % gossip_every == 0``; local steps otherwise.
        gossip_steps: rounds of exchange per gossip step (``W(k)^gossip_steps``).
        gossip_buffers: also mix floating-point buffers (BatchNorm statistics); else keep them local.
        eval_on: ``"average"`` validates, tests and predicts on ``x̄`` (each replica is restored
            afterwards); ``"local"`` on each rank's own replica.

    The remaining arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.

    Example::

        import lightning_decentral  # registers "dpsgd" and "dpsgd_spawn"
        trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4)
        trainer = Trainer(strategy=DecentralizedStrategy(topology="one_peer_exponential"), devices=8)
    """

    strategy_name = "dpsgd"

    def __init__(
        self,
        topology: Union[str, Topology, Any] = "ring",
        combine: Literal["awc", "atc"] = "awc",
        gossip_every: int = 1,
        gossip_steps: int = 1,
        gossip_buffers: bool = True,
        eval_on: Literal["average", "local"] = "average",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        _check_choice("combine", combine, _COMBINE)
        _check_choice("eval_on", eval_on, _EVAL_ON)
        _check_positive_int("gossip_every", gossip_every)
        _check_positive_int("gossip_steps", gossip_steps)
        if isinstance(topology, str) and topology not in TOPOLOGIES:
            raise ValueError(
                f"Unknown topology {topology!r}. Choose one of {sorted(TOPOLOGIES)}, or pass a "
                "Topology, a mixing matrix or a networkx graph."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.combine = combine
        self.gossip_every = gossip_every
        self.gossip_steps = gossip_steps
        self.gossip_buffers = gossip_buffers
        self.eval_on = eval_on
        self._topology_spec = topology
        self._topology: Optional[Topology] = None
        self._gossip: Optional[Gossip] = None
        self._parameters: list[Tensor] = []  # flat buffers the trainable parameters are views of
        self._buffers: list[Tensor] = []  # flat buffers of the mixed module buffers
        self._send: list[Tensor] = []  # AWC: x(k) on the wire, then W x(k) - x(k)
        self._buffer_snapshot: list[Tensor] = []  # AWC: module buffers before the forward pass
        self._pending: Optional[PendingGossip] = None
        self._started_step = -1  # AWC: the step whose exchange has been started
        self._exchanging = False  # AWC: that step mixes (W != I)
        self._averaged_depth = 0
        self._eval_context = contextlib.ExitStack()

    # -- public surface -----------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """The topology, bound to the world size (available once the Trainer is built)."""
        if self._topology is None:
            raise RuntimeError("The topology is bound to the world size when the Trainer is created.")
        return self._topology

    def gossip_rounds(self, step: int) -> int:
        """Rounds of exchange at optimizer step ``step`` (0: a local step, ``W = I``)."""
        if (step + 1) % self.gossip_every or self.topology.is_identity(step):
            return 0
        return self.gossip_steps

    @property
    def flat_parameters(self) -> list[Tensor]:
        """The flat buffers the trainable parameters are views of (one per device and dtype)."""
        return self._parameters

    @contextlib.contextmanager
    def averaged_model(self) -> Iterator[None]:
        """Replace this rank's replica by ``x̄ = (1/n) sum_i x_i`` inside the block, then restore it.

        Parameters and floating-point buffers are averaged with one all-reduce per
        (device, dtype); a nested use is free. Every rank must enter it together.
        """
        module = self.lightning_module
        if self._averaged_depth or module is None or self.world_size == 1:
            self._averaged_depth += 1
            try:
                yield
            finally:
                self._averaged_depth -= 1
            return
        tensors = [t for t in _state_tensors(module) if t.is_floating_point()]
        groups = _group_by_layout(tensors)
        originals = [torch._utils._flatten_dense_tensors(group) for group in groups]
        for group, original in zip(groups, originals):
            mean = original.clone()
            dist.all_reduce(mean)
            mean.div_(self.world_size)
            _copy_flat_into(mean, group)
        self._averaged_depth += 1
        try:
            yield
        finally:
            self._averaged_depth -= 1
            for group, original in zip(groups, originals):
                _copy_flat_into(original, group)

    # -- set-up ---------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _AveragingLauncher(self, start_method=self._start_method)
        # Runs when the Trainer is built, before any process is launched: bad topologies fail here.
        self._topology = resolve_topology(self._topology_spec, self.num_nodes * self.num_processes)

    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)  # calls configure_ddp, then builds the optimizers
            self._check_optimizers()
            return
        # DDPStrategy would broadcast rank 0's weights here: keep every replica as it is.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:
        """Start every replica from rank 0's weights and pack them into flat buffers (no DDP wrapper)."""
        module = self.lightning_module
        assert module is not None
        state = list(_state_tensors(module))
        for group in _group_by_layout(state):
            flat = torch._utils._flatten_dense_tensors(group)
            dist.broadcast(flat, src=0)
            _copy_flat_into(flat, group)
        self._parameters = pack_(p for p in module.parameters() if p.requires_grad)
        mixed_buffers = [b for b in module.buffers() if b.is_floating_point()] if self.gossip_buffers else []
        self._buffers = pack_(mixed_buffers)
        self._gossip = Gossip(self.topology, group=dist.new_group(backend=self.process_group_backend))
        self._send = [torch.empty_like(b) for b in self._parameters + self._buffers] if self.combine == "awc" else []
        self._buffer_snapshot = [torch.empty_like(b) for b in self._buffers] if self.combine == "awc" else []
        self._pending = None
        self._started_step = -1
        self._exchanging = False

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"DecentralizedStrategy mixes the whole model once per optimizer step and needs exactly one "
                f"optimizer, but `configure_optimizers` returned {len(self.optimizers)}. Put the parameters "
                "into one optimizer with several parameter groups."
            )

    # -- one optimizer step -----------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        step = self.lightning_module.trainer.global_step
        if self.combine == "awc" and self._started_step != step:
            self._start_exchange(step)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        step = self.lightning_module.trainer.global_step
        if self.combine == "atc":
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            self._gossip_now(step)
            return output

        if self._started_step != step:  # no batch start before this step (manual optimization)
            self._start_exchange(step)
        corrected = False

        def closure_then_correction() -> Any:
            nonlocal corrected
            result = closure()
            if not corrected:  # an optimizer may call its closure more than once
                self._finish_exchange()
                corrected = True
            return result

        output = super().optimizer_step(optimizer, closure_then_correction, model, **kwargs)
        if not corrected:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() did not call its closure, so the gossip of step {step} "
                "could not be combined. DecentralizedStrategy needs an optimizer that calls the closure."
            )
        if self._exchanging:
            algorithms.add_(self._parameters + self._buffers, self._send)
        self._exchanging = False
        self._started_step = -1
        return output

    def _start_exchange(self, step: int) -> None:
        """AWC: snapshot ``x(k)`` and post its exchange; nothing is posted on a local step."""
        self._finish_exchange()  # one that manual optimization never stepped with
        self._started_step = step
        rounds = self.gossip_rounds(step)
        self._exchanging = rounds > 0
        if not self._exchanging:
            return
        for send, source in zip(self._send, self._parameters + self._buffers):
            send.copy_(source)
        for snapshot, source in zip(self._buffer_snapshot, self._buffers):
            snapshot.copy_(source)
        assert self._gossip is not None
        self._pending = self._gossip.start(self._send, step, rounds)

    def _finish_exchange(self) -> None:
        """AWC: wait for the exchange, then ``send <- W x(k) - x(k)`` (parameters still hold ``x(k)``)."""
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        algorithms.gossip_correction_(self._send, self._parameters + self._buffer_snapshot)

    def _gossip_now(self, step: int) -> None:
        """ATC: ``x <- W(k)^r x`` on the freshly stepped parameters (and buffers)."""
        rounds = self.gossip_rounds(step)
        if rounds:
            assert self._gossip is not None
            self._gossip.start(self._parameters + self._buffers, step, rounds).wait()

    def on_train_end(self) -> None:
        if self._pending is not None:  # posted for a batch that never stepped: drain it
            self._pending.wait()
            self._pending = None
        self._started_step = -1
        super().on_train_end()

    # -- evaluation and checkpoints on the average -----------------------------------

    def on_validation_start(self) -> None:
        self._enter_eval()

    def on_validation_end(self) -> None:
        self._eval_context.close()

    def on_test_start(self) -> None:
        self._enter_eval()

    def on_test_end(self) -> None:
        self._eval_context.close()

    def on_predict_start(self) -> None:
        self._enter_eval()

    def on_predict_end(self) -> None:
        self._eval_context.close()

    def _enter_eval(self) -> None:
        if self.eval_on == "average":
            self._eval_context.enter_context(self.averaged_model())

    def on_exception(self, exception: BaseException) -> None:
        self._eval_context.close()
        super().on_exception(exception)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """``x̄``'s state dict on every rank, so any rank's checkpoint loads into a plain module."""
        with self.averaged_model():
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("dpsgd", "popen"), ("dpsgd_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"Decentralized parallel SGD (gossip) with start_method {start_method!r}",
                override=True,
                start_method=start_method,
            )


class _AveragingLauncher(_MultiProcessingLauncher):
    """Spawn/fork launcher that hands ``x̄``, not rank 0's replica, back to the main process."""

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        assert isinstance(self._strategy, DecentralizedStrategy)
        with self._strategy.averaged_model():
            return super()._collect_rank_zero_results(trainer, results)


def _state_tensors(module: Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _group_by_layout(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _copy_flat_into(flat: Tensor, tensors: list[Tensor]) -> None:
    with torch.no_grad():
        for t, part in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
            t.copy_(part)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer (1 = every step), got {value!r}.")
