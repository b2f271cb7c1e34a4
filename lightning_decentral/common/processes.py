"""What both executors on processes (the Trainer's and Fabric's `DecentralizedStrategy`) hold: the default process
group made on this generation's namespace of the job's store
([`init_default_group`][lightning_decentral.common.processes.init_default_group]), and
[`Processes`][lightning_decentral.common.processes.Processes]: the mixer the driver builds for this rank, the
survivors of a failure (`on_peer_failure="continue"`), a lost rank's way back (`rejoin=True`), what each rank does,
the end of the exchange."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_decentral.agreement import Activities, Ranks
from lightning_decentral.driver import StepDriver
from lightning_decentral.failures import PeerFailure
from lightning_decentral.membership import Decision, Join, Membership, Survivors
from lightning_decentral.membership.rejoin import refuse_after_the_run, refuse_new_rank, run_in_progress
from lightning_decentral.membership.report import losses, says_losses, survivor_metrics
from lightning_decentral.membership.store import store_client
from lightning_decentral.mixing import Mixer
from lightning_decentral.options import GossipOptions
from lightning_decentral.rendezvous import LeftOut, connect, job_token, rejoin_store
from lightning_decentral.sharding import Sharding

log = logging.getLogger(__name__)
Result = TypeVar("Result")


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


class Processes:
    """What an executor on processes (the Trainer's and Fabric's `DecentralizedStrategy`) holds besides Lightning's DDP
    machinery: the default process group made on this generation's namespace of the job's store
    ([`make_default_group`][lightning_decentral.common.processes.Processes.make_default_group]); this rank's mixer and,
    with `on_peer_failure="continue"`, its [`Survivors`][lightning_decentral.membership.Survivors]
    ([`start_gossip`][lightning_decentral.common.processes.Processes.start_gossip],
    [`end_gossip`][lightning_decentral.common.processes.Processes.end_gossip]); the rank and world size after a failure
    or a join ([`rank`][lightning_decentral.common.processes.Processes.rank]); what each rank does (`activities`); and,
    with `rejoin=True`, a lost rank's way back into the run in progress.

    Args:
        driver: the executor's driver: it builds the mixer, the survivors rebind it.
        timeout: the process-group timeout (every collective, exchange and store call).
        ranks: the executor's collectives over the current world (`Ranks` of its device, through the driver's guard).
        rejoin: `rejoin=True`: lost ranks started again rejoin the run in progress (the Trainer's only).
        handover: with `rejoin`, the state this rank hands to a rank that rejoins when it is the source.
        join_margin: with `rejoin`, more steps than two ranks can be apart (a join step is that far ahead).
        on_survivors: the executor's own part of a new membership (after a failure or a join), after this object's.
        sharding: with `shard_size` above 1 (the Trainer's only), the replicas of several ranks: the exchange runs on
            the group of the ranks holding this rank's shard of every replica.
    """

    def __init__(
        self,
        driver: StepDriver,
        timeout: timedelta,
        ranks: Callable[[], Ranks],
        rejoin: bool = False,
        handover: Callable[[], Any] | None = None,
        join_margin: Callable[[], int] | None = None,
        on_survivors: Callable[[Decision], None] = lambda decision: None,
        sharding: Sharding | None = None,
    ) -> None:
        if rejoin and (handover is None or join_margin is None):
            raise ValueError("rejoin=True needs the state to hand over and the join margin.")
        self.driver = driver
        self.timeout = timeout
        self.ranks = ranks
        self.rejoins = rejoin
        self.handover = handover
        self.join_margin = join_margin
        self.executor_on_survivors = on_survivors
        self.survivors: Survivors | None = None  # on_peer_failure="continue", once the gossip started
        self.owns_default_group = False  # this run made the default process group (with its timeout)
        self.joined: Join | None = None  # this process is a lost rank that rejoined, with this decision
        self.joining = False  # a rank that rejoins, before its first training batch
        self.activities: Activities | None = None  # what each rank does (None before set-up)
        self.sharding = sharding  # shard_size > 1: replicas of several ranks

    @property
    def options(self) -> GossipOptions:
        """The driver's update-rule arguments."""
        return self.driver.options

    # -- ranks, after a failure ---------------------------------------------------------------------------------

    def rank(self, lightning: int) -> int:
        """This rank's rank: after a failure or a join, among the members (in the order of their first ranks); before,
        Lightning's (`lightning`)."""
        regrouped = self._regrouped
        return regrouped.rank if regrouped is not None else lightning

    def world_size(self, lightning: int) -> int:
        """The number of ranks: after a failure or a join, of members; before, Lightning's (`lightning`)."""
        regrouped = self._regrouped
        return regrouped.world_size if regrouped is not None else lightning

    @property
    def _regrouped(self) -> Membership | None:
        """The survivors' membership once a failure has regrouped them (`None` before: Lightning's ranks hold)."""
        if self.survivors is not None and self.survivors.membership.generation:
            return self.survivors.membership
        return None

    def start_size(self, current: int) -> int:
        """The number of ranks when the run started (a failure or a rejoin changes the world size; `current` without
        survivors)."""
        return self.survivors.membership.start_size if self.survivors is not None else current

    def first_rank(self, current: int) -> int:
        """This rank's global rank when the run started (a failure renumbers the survivors; `current` without them)."""
        return self.survivors.membership.first_rank if self.survivors is not None else current

    @property
    def failures_survived(self) -> list[Decision]:
        """The survivors' decisions of the run so far (or of the last one), one per failure survived."""
        return list(self.survivors.membership.decisions) if self.survivors is not None else []

    def survivor_metrics(self, world_size: int) -> dict[str, float]:
        """With `on_peer_failure="continue"`: `survivors/workers` (the workers training now) and `survivors/lost` (the
        workers lost so far), for a logger; else nothing."""
        if self.survivors is None:
            return {}
        shard_size = self.sharding.shard_size if self.sharding is not None else 1
        return survivor_metrics(self.survivors.start_topology.world_size, world_size // shard_size)

    # -- the process group and the exchange ----------------------------------------------------------------------

    def bind(self, world_size: int, num_nodes: int) -> None:
        """Before any process starts: bind the driver's topology to the workers (bad ones fail here): the `world_size`
        ranks, or with sharded replicas the replicas of `shard_size` ranks each."""
        workers = self.sharding.bind(world_size) if self.sharding is not None else world_size
        self.driver.bind(workers, num_nodes, rank_zero_warn)

    def check_backend(self, backend: str | None, device: torch.device) -> None:
        """Before any process starts: refuse `on_peer_failure="continue"` on a backend it does not run on
        ([`check_backend`][lightning_decentral.options.GossipOptions.check_backend]: `backend`, or `device`'s
        default)."""
        device_default = dist.Backend.default_device_backend_map.get(device.type, "gloo")
        self.options.check_backend(backend or device_default)

    def make_default_group(
        self, environment: ClusterEnvironment, backend: str, rank: int, world_size: int, device: torch.device
    ) -> None:
        """Make the default process group
        ([`init_default_group`][lightning_decentral.common.processes.init_default_group]); with `rejoin=True`, a lost
        rank started again sets up alone instead, and rejoins the run in progress once it knows what it runs
        ([`rejoin`][lightning_decentral.common.processes.Processes.rejoin])."""
        if self.rejoins and rank > 0:  # rank 0 may host the store: it would wait for itself
            os.environ["MASTER_ADDR"] = environment.main_address
            os.environ["MASTER_PORT"] = str(environment.main_port)
            client = store_client(self.timeout)
            refuse_new_rank(client, rank, world_size)
            refuse_after_the_run(client, rank)
        try:
            init_default_group(environment, backend, rank, world_size, self.timeout, device)
        except LeftOut:
            if not self.rejoins:
                raise
            self._will_rejoin(rank)
        self.owns_default_group = True

    def _will_rejoin(self, rank: int) -> None:
        """A lost rank started again: the job's store is the members' namespace from now on, and it sets up alone (no
        process group yet) until it [`rejoin`][lightning_decentral.common.processes.Processes.rejoin]s, once it knows
        what it runs (its optimizers included)."""
        client = store_client(self.timeout)
        rejoin_store(client, run_in_progress(client, rank)["token"])
        self.joining = True  # until its first batch: Lightning's barrier and broadcast stay on this rank

    def rejoin(self, rank: int, backend: str, configuration: dict[str, int | str]) -> None:
        """A lost rank started again (`rank`, Lightning's), its set-up done
        ([`Survivors.rejoin`][lightning_decentral.membership.Survivors.rejoin]): refused, naming the field, if
        `configuration` (the fields of the members' check that every rank runs the same configuration and optimizers)
        differs from the one the members published; else admitted, the default group is the grown members' (made with
        `backend`)."""
        assert self.handover is not None and self.join_margin is not None
        client = store_client(self.timeout)
        info = run_in_progress(client, rank)
        self.survivors, self.joined = Survivors.rejoin(
            self.driver,
            info,
            rank,
            self.options.min_workers_for(info["start_size"]),
            backend,
            self.timeout,
            self.on_survivors,
            self.handover,
            self.join_margin,
            configuration,
        )
        rank_zero_only.rank = self.survivors.membership.rank

    def start_gossip(self, device: torch.device, launched_by_lightning: bool) -> Mixer:
        """This rank's mixer, built by the driver (every rank together, on the default group); with
        `on_peer_failure="continue"` first the survivors' membership: agree on a run number, start this rank's
        heartbeat, and warn if the job's store cannot outlive a worker. If Lightning's own launcher started any rank
        (`launched_by_lightning`), warn instead and survive nothing (a failure stops every rank, as with `"stop"`): that
        launcher ends every process within seconds of one failing."""
        backend = dist.get_backend()
        if self.options.on_peer_failure == "continue" and not self.joining:
            self.survivors = self._start_surviving(backend, launched_by_lightning)
        group = self.sharding.new_replica_group(self.timeout) if self.sharding is not None else None
        return self.driver.process_mixer(device, backend, self.timeout, self.owns_default_group, self.survivors, group)

    def _start_surviving(self, backend: str, launched_by_lightning: bool) -> Survivors | None:
        self.options.check_backend(backend)  # the process group's, which a user may have made before the strategy
        ranks = self.ranks()
        agreed = ranks.gather([secrets.randbits(62), int(launched_by_lightning)], "Starting the survivors' membership")
        if agreed[:, 1].any():  # every rank alike: rank 0 knows
            rank_zero_warn(LIGHTNING_LAUNCHER)
            return None
        run = int(agreed[0, 0])
        rejoin = (self.join_margin, job_token() or "") if self.rejoins and self.join_margin is not None else None
        sharding = self.sharding  # a worker is a replica of shard_size ranks, lost whole, mixing on its columns
        shard_size = sharding.shard_size if sharding is not None else 1
        exchange_group = (
            (lambda: sharding.regroup(dist.get_world_size(), self.timeout)) if sharding is not None else None
        )
        survivors, warning = Survivors.start(
            self.driver,
            run,
            self.options.min_workers_for(ranks.world_size // shard_size),
            backend,
            self.timeout,
            self.on_survivors,
            rejoin,
            self.handover,
            shard_size,
            exchange_group,
        )
        if warning:
            rank_zero_warn(warning)
        return survivors

    def in_replica(self, step: int, body: Callable[[], Result]) -> Result:
        """`body()`: this rank's forward or backward at optimizer step `step`, in which FSDP's collectives run inside
        its replica (sharded replicas). With `on_peer_failure="continue"`, a backend error there (a rank of the
        replica died: gloo's `Connection closed by peer`, or the timeout) has the survivors agree first: a replica
        goes on only whole, so they leave this one out and this rank stops with
        [`ReplicaLost`][lightning_decentral.membership.ReplicaLost], naming the rank its replica lost. If they keep
        it (the error was no peer's), the error is raised as it is."""
        survivors = self.survivors
        if self.sharding is None or survivors is None:
            return body()
        try:
            return body()
        except RuntimeError as error:
            if isinstance(error, PeerFailure) or survivors.alone:
                raise
            failure = PeerFailure(f"FSDP's collectives inside this rank's replica failed at step {step}: {error}")
            survivors.survive(step, failure)  # raises ReplicaLost when a rank of this replica is lost
            raise

    def start_activities(self) -> Activities:
        """Publish what each rank does from now on, among the ranks of the default group (every rank together)."""
        self.activities = Activities.of_group(self.ranks(), self.timeout)
        return self.activities

    def on_survivors(self, decision: Decision) -> None:
        """After a failure or a join, in the new members' process group (every member together): Lightning's rank-zero
        utilities follow the new rank, and the ranks publish their activities among the members. After a join, each
        member republishes the batch it is in (the join step's) as its first: the rank that rejoins begins that batch
        as its first, so that both count their later activities alike. Then the executor's own part."""
        rank_zero_only.rank = self.ranks().rank
        if self.activities is not None:
            current = self.activities.current
            self.start_activities()
            if isinstance(decision, Join):
                self.activities.start(current)
        self.executor_on_survivors(decision)

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
            if lost and says_losses(self.failures_survived, self.survivors.membership.first_rank):
                log.info(lost)


def launched_by_lightning(start_method: str, launcher: Any, environment: ClusterEnvironment) -> bool:
    """Whether Lightning's own launcher started this rank (`devices=n` from a script, or a `_spawn`/`_fork` strategy):
    it ends every process within seconds of one failing, so with it no rank survives a failure. Known on rank 0 (the
    script's process, whose launcher started the others, or is about to), not always on the others (Lightning starts
    them with the environment of a process launched by anything else)."""
    if start_method != "popen" or getattr(launcher, "procs", None):  # the ranks it started
        return True
    return not environment.creates_processes_externally  # before it starts them
