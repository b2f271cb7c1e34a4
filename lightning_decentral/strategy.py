"""``DecentralizedStrategy``: Lightning's DDP machinery, with gossip instead of all-reduce.

One optimizer step ``k`` on rank ``i``, adapt-with-combine (the default)::

    on_train_batch_start   post the exchange of x_i(k) (the parameter buffers are sent as they are)
    closure                forward + backward on the local shard (bytes in flight)
    end of the closure     wait: correction buffers <- W(k) x(k) - x_i(k)
    optimizer.step()       x_i <- U(x_i(k), g_i)
    after the step         x_i(k+1) <- x_i + (W(k) x(k) - x_i(k))

adapt-then-combine steps first and then gossips, ``x_i(k+1) = sum_j w_ij U(x_j(k), g_j)``.
DecentLaM sends ``z = x − γ g`` bucket by bucket during backward and steps the optimizer on
``g̃ = (x − W z) / γ`` (the buckets live in :mod:`lightning_decentral.overlap`).
Gradients are never all-reduced and the module is never wrapped in
``DistributedDataParallel``; launching, cluster environments, samplers,
``barrier``, ``broadcast`` and ``reduce`` are ``DDPStrategy``'s own.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import secrets
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_decentral import algorithms
from lightning_decentral import checkpoint as shards
from lightning_decentral.gossip import Gossip, PendingGossip, pack_
from lightning_decentral.overlap import GradientBuckets
from lightning_decentral.topology import TOPOLOGIES, Topology, resolve_topology

if TYPE_CHECKING:  # annotations only; a LightningCLI config is parsed against them
    import networkx
    import numpy as np

_COMBINE = ("awc", "atc")
_EVAL_ON = ("average", "local")
_MOMENTUM = ("local", "decentlam")
TopologyName = Literal[tuple(TOPOLOGIES)]  # type: ignore[valid-type]  # a config names one of these, checked when parsed


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
        combine: ``"awc"`` (adapt-with-combine) or ``"atc"`` (adapt-then-combine); ignored by DecentLaM.
        momentum: ``"local"`` (the optimizer's own momentum, the rules above) or ``"decentlam"``:
            ``z_j = x_j − γ g_j``, ``g̃_i = (x_i − sum_j w_ij z_j) / γ``, ``x_i(k+1) = U(x_i(k), g̃_i)``
            (ALGORITHMS.md §3); each bucket of ``z`` is exchanged as soon as its gradients exist.
        gossip_every: gossip on steps with ``(k + 1) % gossip_every == 0``; local steps otherwise.
        gossip_steps: rounds of exchange per gossip step (``W(k)^gossip_steps``).
        gossip_buffers: also mix floating-point buffers (BatchNorm statistics); else keep them local.
        eval_on: ``"average"`` validates, tests and predicts on ``x̄`` (each replica is restored
            afterwards); ``"local"`` on each rank's own replica.
        bucket_cap_mb: DecentLaM's bucket size: the unit of communication overlapped with backward.
        gossip_dtype: send point-to-point messages in this precision (``torch.bfloat16`` or
            ``torch.float16``; ``None``: the parameters' own). Replicas and optimizer state stay in
            full precision; the exchange keeps ``x̄`` exactly and feeds the rounding error back
            (``x_i <- x_i + sum_j w_ij q_j - q_i``, see :mod:`lightning_decentral.gossip`).
            All-reduces (``complete``) stay in full precision.

    The remaining arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.

    Example::

        import lightning_decentral  # registers "dpsgd", "decentlam" and their "_spawn" variants
        trainer = Trainer(strategy="dpsgd", accelerator="cpu", devices=4)
        trainer = Trainer(strategy=DecentralizedStrategy(topology="one_peer_exponential"), devices=8)
        trainer = Trainer(strategy="decentlam", devices=8)  # large batch, momentum SGD
    """

    strategy_name = "dpsgd"

    def __init__(
        self,
        topology: Union[
            TopologyName, Topology, list[list[float]], list[list[list[float]]], np.ndarray, Tensor, networkx.Graph
        ] = "ring",
        combine: Literal["awc", "atc"] = "awc",
        momentum: Literal["local", "decentlam"] = "local",
        gossip_every: int = 1,
        gossip_steps: int = 1,
        gossip_buffers: bool = True,
        eval_on: Literal["average", "local"] = "average",
        bucket_cap_mb: float = 4.0,
        gossip_dtype: Optional[torch.dtype] = None,
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
        _check_choice("momentum", momentum, _MOMENTUM)
        if not bucket_cap_mb > 0:
            raise ValueError(f"`bucket_cap_mb` must be positive, got {bucket_cap_mb!r}.")
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
        self.momentum = momentum
        self.bucket_cap_mb = bucket_cap_mb
        self.gossip_dtype = _check_gossip_dtype(gossip_dtype)
        self.gossip_every = gossip_every
        self.gossip_steps = gossip_steps
        self.gossip_buffers = gossip_buffers
        self.eval_on = eval_on
        self._topology_spec = topology
        self._topology: Optional[Topology] = None
        self._gossip: Optional[Gossip] = None
        self._parameters: list[Tensor] = []  # flat buffers the trainable parameters are views of
        self._buffers: list[Tensor] = []  # flat buffers of the mixed module buffers
        self._send: list[Tensor] = []  # AWC: W x(k) - x(k), the correction
        self._buffer_snapshot: list[Tensor] = []  # AWC: module buffers before the forward pass
        self._pending: Optional[PendingGossip] = None
        self._started_step = -1  # AWC: the step whose exchange has been started
        self._exchanging = False  # AWC: that step mixes (W != I)
        self._buckets: Optional[GradientBuckets] = None  # DecentLaM
        self._hooks: list[Any] = []
        self._failed = False  # an exception ended the run: no collective at teardown
        self._armed_step = -1  # DecentLaM: the step the buckets are armed for
        self._modify_at_step = False  # DecentLaM: the optimizer's pre-hook writes g̃
        self._averaged_depth = 0
        self._replica: dict[int, Tensor] = {}  # inside averaged_model: id(tensor) -> this rank's own value
        self._resume_shard: Optional[dict[str, Any]] = None  # fit(ckpt_path=...): this rank's shard, until restored
        self._measure_residuals = False  # monitors asked for the gossip residual
        self._residual: Optional[Tensor] = None  # its value at step self._residual_step
        self._residual_step = -1
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
        tensors: list[Tensor] = []
        if not self._averaged_depth and module is not None and self.world_size > 1:
            tensors = [t for t in _state_tensors(module) if t.is_floating_point()]
        originals = [t.detach().clone() for t in tensors]
        with torch.no_grad():
            for t, mean in zip(tensors, self._mean_over_ranks(tensors)):
                t.copy_(mean)
        if tensors:
            self._replica = {id(t): original for t, original in zip(tensors, originals)}
        self._averaged_depth += 1
        try:
            yield
        finally:
            self._averaged_depth -= 1
            with torch.no_grad():
                for t, original in zip(tensors, originals):
                    t.copy_(original)
            if tensors:
                self._replica = {}

    # -- monitoring surface: what lightning_decentral.callbacks reads and drives -------------

    def measure_residuals(self) -> None:
        """From now on, every exchange of the parameters also measures its gossip residual
        (:meth:`gossip_residual`). Off by default, so that training without monitors does no extra work."""
        self._measure_residuals = True
        if self._gossip is not None:
            self._gossip.measure_residual = True

    def gossip_residual(self, step: int) -> Optional[Tensor]:
        """``‖y_i − sum_j w_ij(k) y_j‖²`` summed over this rank's trainable parameters, for the first round of
        the exchange of step ``k = step``: ``y = x(k)`` (AWC), ``U(x(k), g)`` (ATC), ``z = x(k) − γ g`` (DecentLaM).

        A 0-dim float64 tensor on this rank's device, not synchronized; ``None`` if step ``step`` exchanged
        nothing or :meth:`measure_residuals` was not called.
        """
        return self._residual if self._residual_step == step else None

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter ``p``: its name, ``‖p_i − p̄‖²`` on this rank and ``‖p̄‖²``.

        0-dim float64 tensors, ``p̄ = (1/n) sum_i p_i`` averaged in at least float32. Costs one all-reduce
        of the parameters; every rank must call it together (``Ξ² = (1/n) sum_i sum_p ‖p_i − p̄‖²``).
        """
        named = [(name, p) for name, p in self.lightning_module.named_parameters() if p.requires_grad]
        wide = [p.detach().to(torch.promote_types(p.dtype, torch.float32)) for _, p in named]
        means = self._mean_over_ranks(wide)
        return [
            (name, _squared_norm(w - m), _squared_norm(m)) for (name, _), w, m in zip(named, wide, means)
        ]

    def extra_gossip(self, step: int, rounds: int) -> None:
        """``x <- W(step)^rounds x`` for the parameters and the mixed buffers, now, on top of the step's own
        gossip. Call it between optimizer steps (no exchange in flight), on every rank with the same arguments."""
        if rounds > 0 and self._gossip is not None:
            self._gossip.start(self._parameters + self._buffers, step, rounds).wait()

    def _record_residual(self, step: int, residuals: Optional[list[Tensor]], count: Optional[int] = None) -> None:
        """Keep the sum of the first ``count`` residuals of an exchange (those of the parameters) as ``step``'s."""
        if residuals:
            self._residual = torch.stack([r.to(self.root_device, torch.float64) for r in residuals[:count]]).sum()
            self._residual_step = step

    def _mean_over_ranks(self, tensors: list[Tensor]) -> list[Tensor]:
        """New tensors ``(1/n) sum_i t_i``, one all-reduce per (device, dtype), run on this rank's device."""
        means: dict[int, Tensor] = {}
        for group in _group_by_layout(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.root_device)  # a copy, on the device
            dist.all_reduce(flat)
            _released_by_gloo(flat)
            flat.div_(self.world_size)
            offset = 0
            for t in group:
                means[id(t)] = flat[offset : offset + t.numel()].view_as(t).to(t.device)
                offset += t.numel()
        return [means[id(t)] for t in tensors]

    # -- set-up ---------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _AveragingLauncher(self, start_method=self._start_method)
        # Runs when the Trainer is built, before any process is launched: bad topologies fail here.
        self._topology = resolve_topology(self._topology_spec, self.num_nodes * self.num_processes, self.num_nodes)
        if self.gossip_every > 1 and self._topology.period > 1:  # only the phases (k + 1) % p == 0 mix
            cycle = math.lcm(self.gossip_every, self._topology.period)
            self._topology.check_connected(
                range(self.gossip_every - 1, cycle, self.gossip_every),
                f" on the steps that gossip with gossip_every={self.gossip_every}",
                f"The topology repeats every {self._topology.period} steps: choose a gossip_every that shares "
                f"no factor with {self._topology.period}, or a static topology.",
            )

    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)  # calls configure_ddp, then builds the optimizers
            self._check_optimizers()
            if self.momentum == "decentlam":
                self._setup_decentlam()
            return
        # DDPStrategy would broadcast rank 0's weights here: keep every replica as it is.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._check_same_configuration()
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:
        """Start every replica from rank 0's weights (or from its own shard when resuming) and pack
        them into flat buffers (no DDP wrapper)."""
        module = self.lightning_module
        assert module is not None
        self._check_same_configuration()
        for group in _group_by_layout(list(_state_tensors(module))) if self._resume_shard is None else []:
            flat = torch._utils._flatten_dense_tensors(group)
            dist.broadcast(flat, src=0)
            _copy_flat_into(flat, group)
        self._parameters = pack_(p for p in module.parameters() if p.requires_grad)
        mixed_buffers = [b for b in module.buffers() if b.is_floating_point()] if self.gossip_buffers else []
        self._buffers = pack_(mixed_buffers)
        group = dist.new_group(backend=self.process_group_backend, timeout=self._timeout)  # else torch's 30 min
        dist.all_reduce(torch.zeros(1, device=self.root_device), group=group)  # NCCL: every rank joins first
        self._gossip = Gossip(self.topology, group=group, dtype=self.gossip_dtype, timeout=self._timeout)
        self._failed = False
        self._gossip.measure_residual = self._measure_residuals
        self._send = [torch.empty_like(b) for b in self._parameters + self._buffers] if self._awc else []
        self._buffer_snapshot = [torch.empty_like(b) for b in self._buffers] if self._awc else []
        self._pending = None
        self._started_step = self._armed_step = -1
        self._exchanging = False

    @property
    def _awc(self) -> bool:
        return self.momentum == "local" and self.combine == "awc"

    def _check_trainable_unchanged(self) -> None:
        """The flat buffers hold the parameters trainable at setup; (un)freezing later is not mixed."""
        packed = sum(b.numel() for b in self._parameters)
        trainable = sum(p.numel() for p in self.lightning_module.parameters() if p.requires_grad)
        if trainable != packed:
            raise RuntimeError(
                f"The trainable parameters changed during fit ({packed} elements at setup, {trainable} now), e.g. "
                "by BackboneFinetuning. DecentralizedStrategy mixes the parameters trainable when fit starts: "
                "freeze or unfreeze before fit, or run one fit per phase."
            )

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"DecentralizedStrategy mixes the whole model once per optimizer step and needs exactly one "
                f"optimizer, but `configure_optimizers` returned {len(self.optimizers)}. Put the parameters "
                "into one optimizer with several parameter groups."
            )

    def _setup_decentlam(self) -> None:
        """Gradient buckets, their hooks, and the optimizer pre-hook that swaps in ``g̃``."""
        (optimizer,) = self.optimizers
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("DecentLaM rewrites the gradient once per step; LBFGS re-evaluates it. Use momentum SGD.")
        if type(optimizer) is not torch.optim.SGD:
            rank_zero_warn(
                f"DecentLaM's bias correction is derived for momentum SGD; {type(optimizer).__name__} will step "
                "with the modified gradient, without that guarantee."
            )
        module = self.lightning_module
        assert module is not None and self._gossip is not None
        params = [p for p in module.parameters() if p.requires_grad]
        scaler = self._grad_scaler()
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(
                f"{type(optimizer).__name__} unscales its gradients inside step() (fused=True), after DecentLaM has "
                "replaced them. Use the optimizer without fused=True, or bf16-mixed precision."
            )
        self._buckets = GradientBuckets(
            self._parameters,
            params,
            optimizer,
            self._gossip,
            bucket_bytes=int(self.bucket_cap_mb * 2**20),
            grad_scale=(lambda: scaler._scale) if scaler is not None else (lambda: 1.0),
            check_finite=scaler is None,
        )
        buckets = self._buckets
        self._hooks = [p.register_post_accumulate_grad_hook(buckets.on_gradient) for p in params]
        self._hooks.append(optimizer.register_step_pre_hook(self._before_update))

    # -- one optimizer step -----------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0:
            self._check_trainable_unchanged()
        step = self.lightning_module.trainer.global_step
        if self._awc and self._started_step != step:
            self._start_exchange(step)
        elif self._buckets is not None and self._armed_step != step:
            self._arm_buckets(step, listen=self._can_overlap_backward())

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        step = self.lightning_module.trainer.global_step
        if self._buckets is not None:
            return self._decentlam_step(step, optimizer, closure, model, **kwargs)
        if self.combine == "atc":
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            pending = self._gossip_now(self._parameters + self._buffers, step)
            self._record_residual(step, pending and pending.residuals, len(self._parameters))
            return output
        return self._awc_step(step, optimizer, closure, model, **kwargs)

    def _awc_step(self, step: int, optimizer: Optimizer, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
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

        output = super().optimizer_step(optimizer, closure_then_correction, *args, **kwargs)
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
        for snapshot, source in zip(self._buffer_snapshot, self._buffers):
            snapshot.copy_(source)  # the forward pass updates BatchNorm statistics in place
        assert self._gossip is not None
        # the parameters are only read until the wait (forward and backward do not write them): sent without a copy
        self._pending = self._gossip.start(self._parameters + self._buffer_snapshot, step, rounds, out=self._send)

    def _finish_exchange(self) -> None:
        """AWC: wait for the exchange; then ``send = W x(k) - x(k)``, the correction added after the step."""
        if self._pending is None:
            return
        self._pending.wait()
        self._record_residual(self._started_step, self._pending.residuals, len(self._parameters))
        self._pending = None

    def _gossip_now(self, tensors: list[Tensor], step: int, tag: int = 0) -> Optional[PendingGossip]:
        """``x <- W(k)^r x`` now: ATC's stepped parameters, or DecentLaM's buffers; returns the finished exchange."""
        rounds = self.gossip_rounds(step)
        if not (rounds and tensors):
            return None
        assert self._gossip is not None
        pending = self._gossip.start(tensors, step, rounds, tag)
        pending.wait()
        return pending

    def _can_overlap_backward(self) -> bool:
        """Post DecentLaM buckets from backward, unless clipping (or a module hook that may edit the
        gradients after backward) must see every gradient first."""
        module = self.lightning_module
        edits_gradients = bool(module.trainer.gradient_clip_val) or any(
            is_overridden(hook, module)
            for hook in ("configure_gradient_clipping", "on_after_backward", "on_before_optimizer_step")
        )
        return module.automatic_optimization and not edits_gradients

    def _arm_buckets(self, step: int, listen: bool) -> None:
        assert self._buckets is not None
        self._armed_step = step
        rounds = self.gossip_rounds(step)
        if rounds:
            self._buckets.arm(step, rounds, listen=listen)
        else:
            self._buckets.listening = False  # W = I: g̃ = g, nothing to send

    def _decentlam_step(
        self, step: int, optimizer: Optimizer, closure: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        """DecentLaM: ``z`` goes out per bucket during backward; ``g̃`` replaces ``g`` right before ``U``."""
        buckets = self._buckets
        assert buckets is not None
        if self._armed_step != step:
            self._arm_buckets(step, listen=False)
        if not self.gossip_rounds(step):
            self._armed_step = -1
            return super().optimizer_step(optimizer, closure, *args, **kwargs)
        scaler = self._grad_scaler()
        clipping = not self._can_overlap_backward()

        def closure_then_post() -> Any:
            result = closure()
            if not clipping:
                buckets.post_all(scaler._scale if scaler is not None else 1.0)
            if scaler is not None:
                self._skip_together(buckets)
            return result

        self._modify_at_step = True
        try:
            output = super().optimizer_step(optimizer, closure_then_post, *args, **kwargs)
        finally:
            self._modify_at_step = False
            buckets.drain()
            self._armed_step = -1
        if buckets.late_gradient:
            raise RuntimeError(
                f"A gradient changed after its bucket was sent at step {step} (a second backward?). "
                "DecentLaM needs one backward per optimizer step, or manual optimization."
            )
        self._gossip_now(self._buffers, step, tag=buckets.num_buckets)  # tags below belong to the buckets
        return output

    def _grad_scaler(self) -> Optional[torch.amp.GradScaler]:
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _before_update(self, optimizer: Optimizer, args: Any, kwargs: dict[str, Any]) -> Any:
        """Optimizer step pre-hook: run the closure (backward, unscale, clip), then ``g <- g̃``."""
        if not self._modify_at_step:
            return None
        self._modify_at_step = False
        closure = kwargs.get("closure")
        with torch.enable_grad():
            result = closure() if closure is not None else None
        assert self._buckets is not None
        self._buckets.modify_gradients()
        self._record_residual(self._armed_step, self._buckets.residuals)  # of z, bucket by bucket
        if closure is None:
            return None
        return args, {**kwargs, "closure": lambda: result}

    def _skip_together(self, buckets: GradientBuckets) -> None:
        """GradScaler: if any rank saw inf/NaN, every rank skips this step (and its scale backs off alike)."""
        bad_anywhere = (~buckets.gradients_finite()).to(torch.float32)
        dist.all_reduce(bad_anywhere, op=dist.ReduceOp.MAX)
        buckets.poison_gradients_if(bad_anywhere > 0)

    def on_train_end(self) -> None:
        if self._pending is not None:  # posted for a batch that never stepped: drain it
            self._pending.wait()
            self._pending = None
        self._started_step = self._armed_step = -1
        if self._buckets is not None:
            self._buckets.drain()
        super().on_train_end()

    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._buckets is not None:
            self._buckets.attach_gradients()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning wraps the backward of accumulated micro-batches in this: post no bucket there."""
        if self._buckets is None:
            yield
            return
        listening, self._buckets.listening = self._buckets.listening, False
        try:
            yield
        finally:
            self._buckets.listening = listening

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._buckets = None
        if self._gossip is not None and not self._failed:
            self._close_gossip()
        self._gossip = None  # and its receive buffers
        self._send, self._buffer_snapshot = [], []
        self._resume_shard = None
        super().teardown()

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
        self._failed = True
        self._eval_context.close()
        super().on_exception(exception)

    def _close_gossip(self) -> None:
        """After a run that ended without an exception: every rank leaves the gossip groups together, then
        destroys them, so that repeated fits in one process do not accumulate groups (threads, sockets).
        The barrier comes first: a rank destroying the group closes its connections, which must not
        happen while a slower peer is still receiving its last message. After an exception nothing is
        destroyed: the other ranks may be gone, and those still waiting end through the timeout."""
        assert self._gossip is not None
        dist.barrier(group=self._gossip.group)
        self._gossip.close()
        dist.destroy_process_group(self._gossip.group)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state averaged over ranks, so that a resumed run starts from the mean momentum.

        For DecentLaM this also cancels each rank's consensus term: ``1ᵀ (I − W) = 0``.
        """
        state = super().optimizer_state(optimizer)
        if self.world_size == 1 or not state:
            return state
        per_param = {key: dict(values) for key, values in state["state"].items()}  # never touch the live state
        entries = [
            (values, name)
            for values in per_param.values()
            for name, value in values.items()
            if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0
        ]
        for (values, name), mean in zip(entries, self._mean_over_ranks([values[name] for values, name in entries])):
            values[name] = mean
        return {**state, "state": per_param}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """``x̄``'s state dict on every rank, so any rank's checkpoint loads into a plain module."""
        with self.averaged_model():
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    # -- checkpoints: x̄ for everyone, and a shard per replica for exact resume --------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its shard (:mod:`lightning_decentral.checkpoint`), then rank 0 the checkpoint file.

        Runs on every rank (``Trainer.save_checkpoint``, ``ModelCheckpoint``). In order: agree on a
        random save id; each rank writes its shard under a temporary name and renames it; all ranks
        report success (one all-gather); rank 0 writes ``checkpoint`` (``x̄``, atomically through
        Lightning's ``CheckpointIO``); all ranks learn it is in place; each rank deletes its shards of
        earlier saves to this path. Interrupted anywhere, it leaves the previous checkpoint whole, or
        shards no checkpoint file names.
        """
        save_id = int(self._gather([secrets.randbits(62)])[0, 0])  # rank 0's draw
        checkpoint[shards.META_KEY] = {"save_id": save_id, "world_size": self.world_size}
        shard = shards.shard_path(filepath, self.global_rank, self.world_size, save_id)
        write_file = super().save_checkpoint  # writes on global rank 0 only
        try:
            self._on_every_rank(lambda: shards.write_shard(self._shard(checkpoint, save_id), shard), "write its shard")
            self._on_every_rank(lambda: write_file(checkpoint, filepath, storage_options), "write the checkpoint file")
        except BaseException:
            shards.discard(shard)  # the earlier saves' shards stay: their checkpoint file still names them
            raise
        shards.remove_shards(filepath, self.global_rank, keep=shard)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes the checkpoint file, every rank its own shards of it (``ModelCheckpoint`` calls this on
        every rank when a checkpoint leaves the top k)."""
        super().remove_checkpoint(filepath)
        shards.remove_shards(filepath, self.global_rank)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read the checkpoint file (``weights_only=True`` unless the caller asks otherwise); when fitting, also
        this rank's shard.

        If every rank finds its shard of the same save at the same world size, the checkpoint returned carries
        this rank's replica, optimizer and precision-plugin state, and ``configure_ddp`` keeps the replicas as
        they are (exact resume). Otherwise every replica restarts from ``x̄`` with the averaged optimizer state,
        and rank 0 warns once, saying why.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        meta = checkpoint.get(shards.META_KEY)
        shard, problem = self._read_own_shard(checkpoint_path, meta)
        problems = self._gather([problem])[:, 0].tolist()
        if any(problems):
            rank_zero_warn(_resume_warning(checkpoint_path, problems, meta, self.world_size))
            return checkpoint
        self._resume_shard = shard
        restored = {**checkpoint, "state_dict": shard["state_dict"]}
        if "optimizer_states" in shard:
            restored["optimizer_states"] = shard["optimizer_states"]
        if shard.get("precision"):
            restored[type(self.precision_plugin).__qualname__] = shard["precision"]
        return restored

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Lightning restores the optimizers last: then this rank's strategy state and RNG state, if resuming
        from shards (after this, nothing draws a random number before the training loop makes its iterator)."""
        super().load_optimizer_state_dict(checkpoint)
        shard, self._resume_shard = self._resume_shard, None
        if shard is not None:
            self._load_shard_state(shard["strategy"])
            shards.set_rng_state(shard["rng"])

    def _shard(self, checkpoint: dict[str, Any], save_id: int) -> dict[str, Any]:
        """This rank's part of the checkpoint: replica, optimizer, precision, strategy and RNG state."""
        shard = {
            "save_id": save_id,
            "rank": self.global_rank,
            "world_size": self.world_size,
            "state_dict": self._replica_state_dict(),
            "strategy": self._shard_state(),
            "rng": shards.rng_state(),
        }
        if "optimizer_states" in checkpoint:  # not a weights-only checkpoint
            shard["optimizer_states"] = [optimizer.state_dict() for optimizer in self.optimizers]
            shard["precision"] = self.precision_plugin.state_dict()
        return shard

    def _replica_state_dict(self) -> dict[str, Tensor]:
        """This rank's own state dict, also while :meth:`averaged_model` holds ``x̄`` (a ``ModelCheckpoint``
        saving at the end of validation)."""
        state = self.lightning_module.state_dict(keep_vars=True)
        return {name: self._replica.get(id(value), value).detach() for name, value in state.items()}

    def _shard_state(self) -> dict[str, Any]:
        """The strategy's own state in this rank's shard (tensors and primitives only).

        The exchange keeps nothing between steps but ``W(k)``'s step ``k``; stateful additions (e.g.
        error feedback of a compressed exchange) add their tensors here and read them in
        :meth:`_load_shard_state`.
        """
        return {"step": self.lightning_module.trainer.global_step}

    def _load_shard_state(self, state: dict[str, Any]) -> None:
        step = self.lightning_module.trainer.global_step
        if state["step"] != step:
            raise RuntimeError(f"The shard was saved at step {state['step']} but the checkpoint's loops are at {step}.")

    def _read_own_shard(self, checkpoint_path: _PATH, meta: Optional[dict[str, int]]) -> tuple[Any, int]:
        """``(shard, 0)``, or ``(None, reason)`` with ``reason`` an index into ``_SHARD_PROBLEMS``."""
        if meta is None:
            return None, 1
        if meta["world_size"] != self.world_size:
            return None, 2
        source = shards.resolve(checkpoint_path)
        path = shards.shard_path(source, self.global_rank, self.world_size, meta["save_id"])
        try:
            shard = shards.read_shard(path)
        except FileNotFoundError:
            return None, 4 if shards.shards_of_rank(source, self.global_rank) else 3
        except Exception:  # truncated or foreign content
            return None, 5
        if (shard.get("save_id"), shard.get("rank")) != (meta["save_id"], self.global_rank):
            return None, 4
        return shard, 0

    def _on_every_rank(self, action: Callable[[], Any], what: str) -> None:
        """Run ``action`` here; then, one all-gather later, every rank knows whether every rank succeeded."""
        error: Optional[BaseException] = None
        try:
            action()
        except Exception as exc:
            error = exc
        failed = self._gather([error is not None])[:, 0].nonzero().flatten().tolist()
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"Rank(s) {failed} could not {what} (their logs say why); no checkpoint was written.")

    def _gather(self, values: list[int]) -> Tensor:
        """Every rank's ``values``: a ``[world_size, len(values)]`` int64 CPU tensor (one all-gather, no pickle)."""
        local = torch.tensor(values, dtype=torch.int64, device=self.root_device)
        if not dist.is_initialized():
            return local[None].cpu()
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    # -- every rank runs the same configuration ----------------------------------------

    def _configuration(self) -> dict[str, Union[int, str]]:
        """What every rank must agree on; strings up to 64 characters, digests of what does not fit."""
        module = self.lightning_module
        params = [p for p in module.parameters() if p.requires_grad]
        buffers = [b for b in module.buffers() if b.is_floating_point()] if self.gossip_buffers else []
        topology = self.topology
        return {
            "world size": self.world_size,
            "topology": repr(topology),
            "mixing matrices W(0..period-1)": _digest(*(topology.mixing(k).round(12).tobytes() for k in range(topology.period))),
            "momentum": self.momentum,
            "combine": self.combine,
            "gossip_every": self.gossip_every,
            "gossip_steps": self.gossip_steps,
            "gossip_buffers": int(self.gossip_buffers),
            "eval_on": self.eval_on,
            "bucket bytes": int(self.bucket_cap_mb * 2**20),
            "gossip_dtype": str(self.gossip_dtype),
            "precision": str(getattr(self.precision_plugin, "precision", type(self.precision_plugin).__name__)),
            "trainable parameters (elements)": sum(p.numel() for p in params),
            "trainable parameter shapes and dtypes": _digest(*(f"{tuple(p.shape)}{p.dtype}".encode() for p in params)),
            "mixed buffers (elements)": sum(b.numel() for b in buffers),
        }

    def _check_same_configuration(self) -> None:
        """Stop every rank before any exchange if a rank's configuration differs from rank 0's.

        Each field travels as int64 values (a string as its code points) in one all-gather; the
        error, raised on every rank, names each differing rank and field with both values.
        """
        fields = self._configuration()
        table = self._gather([v for value in fields.values() for v in _encode(value)])
        rows = [_decode(row.tolist(), fields) for row in table]
        differences = [
            f"rank {rank} has {name}={row[name]!r} where rank 0 has {rows[0][name]!r}"
            for rank, row in enumerate(rows)
            for name in fields
            if row[name] != rows[0][name]
        ]
        if differences:
            raise ValueError(
                "The ranks do not run the same configuration: " + "; ".join(differences) + ". Build the same "
                "DecentralizedStrategy and the same model on every rank (no argument may depend on the rank)."
            )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, momentum, start_method in (
            ("dpsgd", "local", "popen"),
            ("dpsgd_spawn", "local", "spawn"),
            ("decentlam", "decentlam", "popen"),
            ("decentlam_spawn", "decentlam", "spawn"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"Decentralized training (gossip), momentum={momentum!r}, start_method {start_method!r}",
                override=True,
                momentum=momentum,
                start_method=start_method,
            )


class _AveragingLauncher(_MultiProcessingLauncher):
    """Spawn/fork launcher that hands ``x̄``, not rank 0's replica, back to the main process."""

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        assert isinstance(self._strategy, DecentralizedStrategy)
        with self._strategy.averaged_model():
            return super()._collect_rank_zero_results(trainer, results)


def _released_by_gloo(tensor: Tensor, limit: float = 1.0) -> None:
    """Wait (at most ``limit`` seconds) until gloo's worker thread has dropped its reference to ``tensor``.

    A blocking gloo collective returns before the worker thread frees the work that holds the tensor.
    If the worker frees it after Python has dropped the tensor, it needs the GIL to free the Python
    object, and if the interpreter is exiting by then the process aborts (``terminate called without
    an active exception``). The average handed back by the spawn launcher is a spawned rank's last
    collective, so it waits here, at most a few milliseconds. CUDA tensors (NCCL) are left alone.
    """
    if tensor.device.type != "cpu":
        return
    deadline = time.monotonic() + limit
    while tensor._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(1e-4)


def _state_tensors(module: Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _group_by_layout(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _squared_norm(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def _copy_flat_into(flat: Tensor, tensors: list[Tensor]) -> None:
    with torch.no_grad():
        for t, part in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
            t.copy_(part)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


_GOSSIP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_gossip_dtype(dtype: Any) -> Optional[torch.dtype]:
    """``None``, or one of ``_GOSSIP_DTYPES`` (also given by name: ``"bfloat16"``, ``"float16"``)."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if resolved not in _GOSSIP_DTYPES:
        names = ", ".join(f"torch.{str(d).split('.')[-1]}" for d in _GOSSIP_DTYPES)
        raise ValueError(
            f"`gossip_dtype` must be None or a floating-point type messages can travel in ({names}), got {dtype!r}. "
            "Use gossip_dtype=torch.bfloat16 to halve the bytes of a float32 model."
        )
    return resolved


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer (1 = every step), got {value!r}.")


_STRING_SLOTS = 64
_SHARD_PROBLEMS = (
    "",
    "the checkpoint records no shards (it was not saved by DecentralizedStrategy)",
    "it was saved by {saved} ranks and this run has {now}",
    "the shard is missing",
    "the shard belongs to another save (overwritten, or written by another run)",
    "the shard cannot be read",
)


def _resume_warning(path: _PATH, problems: list[int], meta: Optional[dict[str, int]], world_size: int) -> str:
    if problems[0] in (1, 2):  # the same file on every rank: one reason
        reason = _SHARD_PROBLEMS[problems[0]].format(saved=meta and meta["world_size"], now=world_size)
    else:
        reason = "; ".join(
            f"rank(s) {[r for r, p in enumerate(problems) if p == code]}: {_SHARD_PROBLEMS[code]}"
            for code in sorted(set(problems) - {0})
        )
        reason += f" (in {shards.shard_directory(shards.resolve(path))})"
    return (
        f"Resuming from {path} with every replica restarted from the averaged model and the averaged optimizer "
        f"state, not from its own: {reason}. An exact resume needs every rank's shard of that save and the same "
        "world size."
    )


def _digest(*parts: bytes) -> int:
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little", signed=True)


def _encode(value: Union[int, str]) -> list[int]:
    if isinstance(value, str):
        codes = [ord(c) for c in value[:_STRING_SLOTS]]
        return codes + [0] * (_STRING_SLOTS - len(codes))
    return [int(value)]


def _decode(row: list[int], like: dict[str, Union[int, str]]) -> dict[str, Union[int, str]]:
    decoded, offset = {}, 0
    for name, value in like.items():
        if isinstance(value, str):
            decoded[name] = "".join(chr(c) for c in row[offset : offset + _STRING_SLOTS] if c)
            offset += _STRING_SLOTS
        else:
            decoded[name] = row[offset]
            offset += 1
    return decoded
