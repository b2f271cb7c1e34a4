"""What both executors on processes (the Trainer's and Fabric's `DecentralizedStrategy`) share: the default process
group made on this generation's namespace of the job's store
([`init_default_group`][lightning_decentral.common.processes.init_default_group]), and
[`OnProcesses`][lightning_decentral.common.processes.OnProcesses]: the mixer the driver builds for this rank, the
survivors of a failure (`on_peer_failure="continue"`), the monitors' collectives, the end of the exchange."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.nn import Module

from lightning_decentral.agreement import Activities, Ranks, parameter_deviations
from lightning_decentral.driver import StepDriver
from lightning_decentral.measures import own_gradients
from lightning_decentral.membership import Decision, Join, Membership, Survivors
from lightning_decentral.membership.guard import Guard
from lightning_decentral.membership.rejoin import refuse_after_the_run, refuse_new_rank, run_in_progress
from lightning_decentral.membership.report import losses, says_losses, survivor_metrics
from lightning_decentral.membership.store import store_client
from lightning_decentral.mixing import Mixer
from lightning_decentral.options import GossipOptions
from lightning_decentral.rendezvous import LeftOut, connect, job_token, rejoin_store
from lightning_decentral.sharding import Sharding

log = logging.getLogger(__name__)


def init_default_group(
    environment: ClusterEnvironment, backend: str, rank: int, world_size: int, timeout: timedelta, device: torch.device
) -> None:
    """Make the default process group on this generation's namespace of the job's store
    ([`rendezvous.connect`][lightning_decentral.rendezvous.connect]), as Lightning would make it otherwise, so that
    workers torchrun restarts never meet the keys of the workers they replace. As Lightning: `MASTER_ADDR` and
    `MASTER_PORT` name the job's store (its clients read them), and NCCL's group is destroyed at exit."""
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    store = connect(environment.main_address, environment.main_port, rank, world_size, timeout)
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    device_id = device if device.type != "cpu" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
    if backend == "nccl":  # torch warns of an NCCL group left at exit
        atexit.register(_destroy_default_group)
    line = "-" * 100
    rank_zero_info(
        f"{line}\ndistributed_backend={backend}\nAll distributed processes registered. Starting with {world_size} "
        f"processes\n{line}\n"
    )


def _destroy_default_group() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as Lightning: Ctrl+C does not interrupt it
    if dist.is_initialized():  # the survivors of a failure may have replaced it: the current one
        dist.destroy_process_group()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


LIGHTNING_LAUNCHER = (
    "on_peer_failure='continue' has no effect under Lightning's own launcher (devices=n from a script, or a "
    "'_spawn'/'_fork' strategy): it ends every process within seconds of one failing, so a failure stops every rank, "
    "as with 'stop'. To survive failures, launch with lightning-decentral-launch (or one process per worker, e.g. "
    "srun without --kill-on-bad-exit)."
)
"""The warning at start under Lightning's own launcher with `on_peer_failure="continue"`."""


class OnProcesses:
    """What an executor on processes adds to Lightning's DDP strategy (list it before Lightning's strategy class):
    this rank's mixer and, with `on_peer_failure="continue"`, its
    [`Survivors`][lightning_decentral.membership.Survivors]
    ([`start_gossip`][lightning_decentral.common.processes.OnProcesses.start_gossip],
    [`end_gossip`][lightning_decentral.common.processes.OnProcesses.end_gossip]); its rank and world size follow the
    survivors of a failure; the monitors' collectives over the module it trains (`trained_module`)."""

    driver: StepDriver
    options: GossipOptions
    root_device: torch.device
    activities: Activities | None  # what each rank does (None before set-up): the executor's
    survivors: Survivors | None = None  # on_peer_failure="continue", once the gossip started
    owns_default_group = False  # this run made the default process group (with its timeout)
    rejoins = False  # rejoin=True: lost ranks started again rejoin the run in progress
    joined: Join | None = None  # this process is a lost rank that rejoined, with this decision
    joining = False  # a rank that rejoins, before its first training batch
    sharding: Sharding | None = None  # shard_size > 1: replicas of several ranks (the Trainer's strategy only)
    _timeout: timedelta  # Lightning's DDPStrategy keeps it

    def _configure_launcher(self) -> None:
        """Runs when the Trainer or Fabric is built, before any process starts: refuse `on_peer_failure="continue"` on
        a backend it does not run on ([`check_backend`][lightning_decentral.options.GossipOptions.check_backend]: the
        backend passed, or the device's default), and bind the topology (bad ones fail here)."""
        device_default = dist.Backend.default_device_backend_map.get(self.root_device.type, "gloo")
        self.options.check_backend(self.process_group_backend or device_default)  # type: ignore[attr-defined]
        super()._configure_launcher()  # type: ignore[misc]
        world_size = self.num_nodes * self.num_processes  # type: ignore[attr-defined]
        workers = self.sharding.bind(world_size) if self.sharding is not None else world_size  # sharded: the replicas
        self.driver.bind(workers, self.num_nodes)  # type: ignore[attr-defined]

    @property
    def trained_module(self) -> Module:
        """The module this rank trains (its replica)."""
        raise NotImplementedError

    # -- the monitors' collectives ------------------------------------------------------------------------------

    def parameter_deviations(self) -> list[tuple[str, Tensor, Tensor]]:
        """For each trainable parameter `p`: its name, `‖p_i − p̄‖²` on this rank and `‖p̄‖²`.

        0-dim float64 tensors, `p̄ = (1/n) Σ_i p_i` averaged in at least float32. Costs one all-reduce
        of the parameters; every rank must call it together (`Ξ² = (1/n) Σ_i Σ_p ‖p_i − p̄‖²`).
        """
        if self.sharding is not None:  # this rank's shard's part of its replica's term
            return self.sharding.parameter_deviations(self.replica_ranks, self.trained_module)
        return parameter_deviations(self._ranks, self.trained_module)

    def gradient_sum(self) -> list[Tensor]:
        """This rank's gradient of each trainable parameter (zeros where it has none)."""
        return own_gradients(self.trained_module)

    @property
    def _ranks(self) -> Ranks:
        return Ranks.of_world(self.root_device, self.guard)

    @property
    def replica_ranks(self) -> Ranks:
        """The ranks a mean over the replicas runs on: every rank; with sharded replicas, the ranks holding this rank's
        shard of every replica (its column of the device mesh)."""
        if self.sharding is not None:
            return self.sharding.replica_ranks(self.root_device, self.guard)
        return self._ranks

    # -- every collective goes through the driver's guard ---------------------------------------------------------

    @property
    def guard(self) -> Guard:
        """The path every collective of this rank goes through besides the exchange
        ([`Guard`][lightning_decentral.membership.guard.Guard]): with `on_peer_failure="continue"`, a failure in any of
        them is survived (a checkpoint save then starts again among the survivors: see the strategies'
        `save_checkpoint`)."""
        return self.driver.guard

    # -- ranks, after a failure ---------------------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        """This rank's rank; after a failure, among the survivors (in the order of their first ranks)."""
        regrouped = self._regrouped
        return regrouped.rank if regrouped is not None else super().global_rank  # type: ignore[misc]

    @property
    def world_size(self) -> int:
        """The number of ranks; after a failure, of survivors."""
        regrouped = self._regrouped
        return regrouped.world_size if regrouped is not None else super().world_size  # type: ignore[misc]

    @property
    def _regrouped(self) -> Membership | None:
        """The survivors' membership once a failure has regrouped them (`None` before: Lightning's ranks hold)."""
        if self.survivors is not None and self.survivors.membership.generation:
            return self.survivors.membership
        return None

    @property
    def first_rank(self) -> int:
        """This rank's global rank when the run started (a failure renumbers the survivors)."""
        return self.survivors.membership.first_rank if self.survivors is not None else self.global_rank

    @property
    def start_size(self) -> int:
        """The number of ranks when the run started (a failure or a rejoin changes `world_size`)."""
        return self.survivors.membership.start_size if self.survivors is not None else self.world_size

    @property
    def failures_survived(self) -> list[Decision]:
        """The survivors' decisions of the run so far (or of the last one), one per failure survived."""
        return list(self.survivors.membership.decisions) if self.survivors is not None else []

    @property
    def start_method(self) -> str:
        """How Lightning's launcher starts the ranks: `start_method=`, or the registered name's (`"dpsgd_fork"`:
        `"fork"`); `"popen"` runs the script once per rank."""
        return self._start_method  # type: ignore[attr-defined]  # Lightning's DDPStrategy keeps it

    @property
    def launched_by_lightning(self) -> bool:
        """Whether Lightning's own launcher started this rank (`devices=n` from a script, or a `_spawn`/`_fork`
        strategy): it ends every process within seconds of one failing, so with it no rank survives a failure. Known
        on rank 0 (the script's process, whose launcher started the others, or is about to), not always on the others
        (Lightning starts them with the environment of a process launched by anything else)."""
        if self.start_method != "popen" or getattr(self.launcher, "procs", None):  # type: ignore[attr-defined]  # the ranks it started
            return True
        return not self.cluster_environment.creates_processes_externally  # type: ignore[attr-defined]  # before it starts them

    # -- the process group and the exchange ----------------------------------------------------------------------

    def make_default_group(self) -> None:
        """Make the default process group, once the executor set its world ranks
        ([`init_default_group`][lightning_decentral.common.processes.init_default_group])."""
        backend = self._process_group_backend = self._get_process_group_backend()  # type: ignore[attr-defined]
        environment = self.cluster_environment  # type: ignore[attr-defined]
        assert environment is not None
        if self.rejoins and self.global_rank > 0:  # rank 0 may host the store: it would wait for itself
            os.environ["MASTER_ADDR"] = environment.main_address
            os.environ["MASTER_PORT"] = str(environment.main_port)
            client = store_client(self._timeout)
            refuse_new_rank(client, self.global_rank, self.world_size)
            refuse_after_the_run(client, self.global_rank)
        try:
            init_default_group(environment, backend, self.global_rank, self.world_size, self._timeout, self.root_device)
        except LeftOut:
            if not self.rejoins:
                raise
            self._will_rejoin()
        self.owns_default_group = True

    def _will_rejoin(self) -> None:
        """A lost rank started again: the job's store is the members' namespace from now on, and it sets up alone (no
        process group yet) until it [`rejoin`][lightning_decentral.common.processes.OnProcesses.rejoin]s, once it
        knows what it runs (its optimizers included)."""
        client = store_client(self._timeout)
        rejoin_store(client, run_in_progress(client, self.global_rank)["token"])
        self.joining = True  # until its first batch: Lightning's barrier and broadcast stay on this rank

    def rejoin(self, configuration: dict[str, int | str]) -> None:
        """A lost rank started again, its set-up done
        ([`Survivors.rejoin`][lightning_decentral.membership.Survivors.rejoin]): refused, naming the field, if
        `configuration` (the fields of the members' check that every rank runs the same configuration and optimizers)
        differs from the one the members published; else admitted, the default group is the grown members'."""
        client = store_client(self._timeout)
        info = run_in_progress(client, self.global_rank)
        self.survivors, self.joined = Survivors.rejoin(
            self.driver,
            info,
            self.global_rank,
            self.options.min_workers_for(info["start_size"]),
            self._process_group_backend,  # type: ignore[attr-defined]
            self._timeout,
            self.on_survivors,
            self.handover_state,
            self.join_margin,
            configuration,
        )
        rank_zero_only.rank = self.global_rank

    def handover_state(self) -> Any:
        """What this rank hands to a lost rank that rejoins, when it is the source (`rejoin=True`)."""
        raise NotImplementedError

    def join_margin(self) -> int:
        """More steps than two ranks can be apart (a join step is that far ahead of the step it is proposed at)."""
        raise NotImplementedError

    def start_gossip(self) -> Mixer:
        """This rank's mixer, built by the driver (every rank together, on the default group); with
        `on_peer_failure="continue"` first the survivors' membership: agree on a run number, start this rank's
        heartbeat, and warn if the job's store cannot outlive a worker. If Lightning's own launcher started any rank,
        warn instead and survive nothing (a failure stops every rank, as with `"stop"`): that launcher ends every
        process within seconds of one failing."""
        backend = dist.get_backend()
        if self.options.on_peer_failure == "continue" and not self.joining:
            self.survivors = self._start_surviving(backend)
        group = self.sharding.new_replica_group(self._timeout) if self.sharding is not None else None
        return self.driver.process_mixer(
            self.root_device, backend, self._timeout, self.owns_default_group, self.survivors, group
        )

    def _start_surviving(self, backend: str) -> Survivors | None:
        self.options.check_backend(backend)  # the process group's, which a user may have made before the strategy
        agreed = self._ranks.gather(
            [secrets.randbits(62), int(self.launched_by_lightning)], "Starting the survivors' membership"
        )
        if agreed[:, 1].any():  # every rank alike: rank 0 knows
            rank_zero_warn(LIGHTNING_LAUNCHER)
            return None
        run = int(agreed[0, 0])
        min_workers = self.options.min_workers_for(self.world_size)
        rejoin = (self.join_margin, job_token() or "") if self.rejoins else None
        survivors, warning = Survivors.start(
            self.driver, run, min_workers, backend, self._timeout, self.on_survivors, rejoin, self.handover_state
        )
        if warning:
            rank_zero_warn(warning)
        return survivors

    def on_survivors(self, decision: Decision) -> None:
        """After a failure or a join, in the new members' process group (every member together): Lightning's rank-zero
        utilities follow the new rank, and the ranks publish their activities among the members. After a join, each
        member republishes the batch it is in (the join step's) as its first: the rank that rejoins begins that batch
        as its first, so that both count their later activities alike."""
        rank_zero_only.rank = self.global_rank
        if self.activities is not None:
            current = self.activities.current
            self.activities = Activities.of_group(self._ranks, self._timeout)
            if isinstance(decision, Join):
                self.activities.start(current)

    @property
    def survivor_metrics(self) -> dict[str, float]:
        """With `on_peer_failure="continue"`: `survivors/workers` (the workers training now) and `survivors/lost` (the
        workers lost so far), for a logger; else nothing."""
        if self.survivors is None:
            return {}
        return survivor_metrics(self.survivors.start_topology.world_size, self.world_size)

    def end_gossip(self, mixer: Any | None, step: int, failed: bool) -> None:
        """The run is over: after a clean run every rank leaves the mixer's groups together (at `step`); after an
        error (the others may be gone) the mixer is aborted (a stale mixer's threads end, and its neighbours learn of
        the failure at once). The heartbeat stops, with one line if the run lost workers (logged by one rank:
        `membership.report.says_losses`); the ranks stay the survivors'."""
        if mixer is not None and not failed:
            mixer.leave(step)
        elif mixer is not None:
            mixer.abort()
        if self.survivors is not None:
            self.survivors.close()
            lost = losses(self.failures_survived)
            if lost and says_losses(self.failures_survived, self.first_rank):
                log.info(lost)
