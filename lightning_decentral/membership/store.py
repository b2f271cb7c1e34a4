"""The job's key-value store, which the survivors of a failure agree through: reaching it, and where it lives
([`store_host`][lightning_decentral.membership.store_host]). Every call they make to it runs under
[`GuardedStore`][lightning_decentral.rendezvous.GuardedStore] (calls that cannot hang), as the per-batch calls of the
executors do.

Every launcher of `torch.distributed` has one `TCPStore`, at `MASTER_ADDR:MASTER_PORT`: rank 0's process hosts it
(Lightning's own launcher, `mp.spawn`, SLURM's `srun`, a plain `init_process_group("env://")`), or torchrun's agent
does (`TORCHELASTIC_USE_AGENT_STORE=True`), or `lightning-decentral-launch` does (it marks the store with
`LAUNCHER_KEY`). Whoever hosts it is the one process whose death nothing survives.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_decentral.rendezvous import GuardedStore, StoreLost

__all__ = ["LAUNCHER_KEY", "GuardedStore", "StoreLost", "store_client", "store_host"]

LAUNCHER_KEY = "lightning_decentral/launcher"  # set by lightning-decentral-launch in the store it hosts


def store_client(timeout: timedelta) -> dist.TCPStore:
    """A new client of the job's store at `MASTER_ADDR:MASTER_PORT` (set by every launcher, or by Lightning before
    it makes the process group): the membership's own connection, outside any generation's namespace
    ([`rendezvous.job_store`][lightning_decentral.rendezvous.job_store] is the default group's), so that it is
    there, and can be reconnected, whatever becomes of the process groups."""
    address = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not address or not port:
        raise RuntimeError(
            "on_peer_failure='continue' agrees through the job's store at MASTER_ADDR:MASTER_PORT, but they are not "
            "set: start the run with a launcher (lightning-decentral-launch, torchrun, or Lightning's own)."
        )
    return dist.TCPStore(address, int(port), is_master=False, timeout=timeout)


def store_host(store: Any) -> tuple[bool, str]:
    """Whether the job's store outlives every worker, and who hosts it, in words.

    Examples:
        ```python
        store_host(store_client(timedelta(seconds=30)))
        # (False, "rank 0's process hosts the job's store (...)")
        ```
    """
    if store.check([LAUNCHER_KEY]):
        return (
            True,
            f"lightning-decentral-launch hosts the job's store ({store.get(LAUNCHER_KEY).decode()}), outside the "
            "workers",
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False, (
            "torchrun's agent on the first node hosts the job's store, but torchrun stops every worker of a node when "
            "one of them fails: launch with lightning-decentral-launch, or one process per worker (srun without "
            "--kill-on-bad-exit)"
        )
    return False, (
        "rank 0's process hosts the job's store (a launch by Lightning, mp.spawn, srun or a plain env:// process "
        "group): the survivors go on after any failure but rank 0's; to survive that too, launch with "
        "lightning-decentral-launch, which hosts the store outside the workers"
    )
