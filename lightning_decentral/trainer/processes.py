"""What both executors on processes (the Trainer's and Fabric's `DecentralizedStrategy`) share: the default process
group made on this generation's namespace of the job's store
([`init_default_group`][lightning_decentral.trainer.processes.init_default_group]), and what they add for
`on_peer_failure="continue"` ([`Survives`][lightning_decentral.trainer.processes.Survives])."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_decentral.agreement import Ranks
from lightning_decentral.driver import StepDriver
from lightning_decentral.failures import Activities
from lightning_decentral.membership import Decision, Membership, Survivors
from lightning_decentral.membership.report import losses, survivor_metrics
from lightning_decentral.options import GossipOptions
from lightning_decentral.rendezvous import connect


def init_default_group(
    environment: ClusterEnvironment, backend: str, rank: int, world_size: int, timeout: timedelta, device: torch.device
) -> None:
    """Make the default process group on this generation's namespace of the job's store
    ([`rendezvous.connect`][lightning_decentral.rendezvous.connect]), as Lightning would make it otherwise, so that
    workers torchrun restarts never meet the keys of the workers they replace."""
    store = connect(environment.main_address, environment.main_port, rank, world_size, timeout)
    device_id = device if device.type != "cpu" else None
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device_id, store=store)


LIGHTNING_LAUNCHER = (
    "on_peer_failure='continue' has no effect under Lightning's own launcher (devices=n from a script, or a "
    "'_spawn'/'_fork' strategy): it ends every process within seconds of one failing, so a failure stops every rank, as "
    "with 'stop'. To survive failures, launch with lightning-decentral-launch (or one process per worker, e.g. srun "
    "without --kill-on-bad-exit)."
)
"""The warning at start under Lightning's own launcher with `on_peer_failure="continue"`."""


class Survives:
    """What an executor on processes adds for `on_peer_failure="continue"` (the Trainer's and Fabric's
    `DecentralizedStrategy`; list it before Lightning's strategy class): its rank and world size follow the
    survivors of a failure, and `start_surviving`/`stop_surviving` bracket a run
    ([`Survivors`][lightning_decentral.membership.Survivors] does the rest, from the mixer's waits)."""

    driver: StepDriver
    options: GossipOptions
    activities: Optional[Activities]  # what each rank does (None before set-up): the executor's

    def _configure_launcher(self) -> None:
        """Runs when the Trainer or Fabric is built: refuse `on_peer_failure="continue"` on a backend it does not run on
        ([`check_backend`][lightning_decentral.options.GossipOptions.check_backend]: the backend passed, or the
        device's default)."""
        device_default = dist.Backend.default_device_backend_map.get(self.root_device.type, "gloo")  # type: ignore[attr-defined]
        self.options.check_backend(self.process_group_backend or device_default)  # type: ignore[attr-defined]
        super()._configure_launcher()  # type: ignore[misc]

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
    def _regrouped(self) -> Optional[Membership]:
        """The survivors' membership once a failure has regrouped them (`None` before: Lightning's ranks hold)."""
        survivors = self.driver.survivors
        if survivors is not None and survivors.membership.generation:
            return survivors.membership
        return None

    @property
    def first_rank(self) -> int:
        """This rank's global rank when the run started (a failure renumbers the survivors)."""
        survivors = self.driver.survivors
        return survivors.membership.first_rank if survivors is not None else self.global_rank

    @property
    def failures_survived(self) -> list[Decision]:
        """The survivors' decisions of the run so far (or of the last one), one per failure survived."""
        survivors = self.driver.survivors
        return list(survivors.membership.decisions) if survivors is not None else []

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

    def start_surviving(self, mixer: Any, device: Any, backend: str, timeout: timedelta, warn: Callable[[str], None]) -> None:
        """With `on_peer_failure="continue"`: agree on a run number (every rank together, on the default group), start
        this rank's heartbeat, watch `mixer`'s exchanges, and `warn` if the job's store cannot outlive a worker. If
        Lightning's own launcher started any rank, `warn` instead and survive nothing (a failure stops every rank, as
        with `"stop"`): that launcher ends every process within seconds of one failing."""
        if self.options.on_peer_failure != "continue":
            return
        self.options.check_backend(backend)  # the process group's, which a user may have made before the strategy
        agreed = Ranks.of_world(device).gather([secrets.randbits(62), int(self.launched_by_lightning)], "Starting the survivors' membership")
        if agreed[:, 1].any():  # every rank alike: rank 0 knows
            warn(LIGHTNING_LAUNCHER)
            return
        run = int(agreed[0, 0])
        min_workers = self.options.min_workers_for(self.world_size)
        survivors, warning = Survivors.start(self.driver, run, min_workers, backend, timeout, self.on_survivors)
        survivors.watch(mixer)
        self.driver.survivors = survivors
        if warning:
            warn(warning)

    def on_survivors(self, decision: Decision) -> None:
        """After a failure, in the survivors' process group (every survivor together): Lightning's rank-zero utilities
        follow the new rank, and the ranks publish their activities among the survivors."""
        rank_zero_only.rank = self.global_rank
        if self.activities is not None:
            self.activities = Activities.of_group(Ranks.of_world(self.root_device), self._timeout)  # type: ignore[attr-defined]

    @property
    def survivor_metrics(self) -> dict[str, float]:
        """With `on_peer_failure="continue"`: `survivors/workers` (the workers training now) and `survivors/lost` (the
        workers lost so far), for a logger; else nothing."""
        if self.driver.survivors is None:
            return {}
        return survivor_metrics(self.failures_survived, self.world_size)

    def stop_surviving(self) -> None:
        """Stop the heartbeat (the run is over, or failed), and warn once if the run lost workers; the ranks stay the
        survivors'."""
        if self.driver.survivors is not None:
            self.driver.survivors.close()
            lost = losses(self.failures_survived)
            if lost:
                rank_zero_warn(lost)
