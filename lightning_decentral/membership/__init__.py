"""Who is still in the run, agreed through the job's store: `on_peer_failure="continue"` on processes.

A decentralized run needs no global state to go on after a worker dies: each worker only averages with a few
neighbours. What the survivors need is to agree, quickly and all alike, on who is left and from which step they mix
again, and a process group of their own. This package does that, Lightning-free, below the driver:

* [`Membership`][lightning_decentral.membership.Membership]: heartbeats in the store; the announcement of a failure,
  which every member sees within one poll of its wait; the agreement on the members and one step
  ([`Decision`][lightning_decentral.membership.Decision]);
* [`Survivors`][lightning_decentral.membership.Survivors]: what a rank does when an exchange fails (the mixer's
  [`Survival`][lightning_decentral.failures.Survival]): close the old groups, agree, take the steps up to the agreed
  one alone, then form the survivors' group and rebind the driver's topology and mixer;
* [`Guard`][lightning_decentral.membership.guard.Guard]: the one path every other collective goes through (a save's
  agreements, Lightning's reduce, `x̄`), which hands its failure to the same survivors and completes it among them;
* [`Beacon`][lightning_decentral.membership.beacon.Beacon]: whether a member's process is gone, asked at once;
* [`poison`][lightning_decentral.membership.poison] closes a generation's process group for good (what makes every
  pending operation on it fail, here and at the peers), and `Membership.form_group` makes the survivors' default
  process group on a fresh prefix of the store;
* [`store_client`][lightning_decentral.membership.store_client],
  [`GuardedStore`][lightning_decentral.rendezvous.GuardedStore] (store calls that cannot hang, from `rendezvous`) and
  [`store_host`][lightning_decentral.membership.store_host] (whether the store outlives the workers);
* `report.py`: what a run says about its failures (a line per decision on every survivor, the metrics, the warning
  at the end);
* `launch.py`: `lightning-decentral-launch`, a launcher that hosts the store outside the workers and lets the
  survivors live when one of them dies (and, with `--max-restarts`, starts it again);
* [`rejoin`][lightning_decentral.membership.rejoin]: a lost rank started again asks to rejoin; the members agree on a
  join step and admit it ([`Join`][lightning_decentral.membership.Join]); a neighbour hands it its state.

The rule of repair (`docs/reliability.md`, "Surviving a failure"): every survivor discards each exchange it has not
completed and keeps each one it has; the survivors agree on the largest step at which one of them gave up an
exchange, take local steps up to it, and mix from the next step on with the topology of the survivors.
"""

from lightning_decentral.membership.groups import poison, rebuild_world
from lightning_decentral.membership.protocol import Decision, Excluded, Join, Membership, ReplicaLost, TooFewWorkers
from lightning_decentral.membership.store import LAUNCHER_KEY, GuardedStore, StoreLost, store_client, store_host
from lightning_decentral.membership.survivors import Survivors, form_for_save

__all__ = [
    "LAUNCHER_KEY",
    "Decision",
    "Excluded",
    "GuardedStore",
    "Join",
    "Membership",
    "ReplicaLost",
    "StoreLost",
    "Survivors",
    "TooFewWorkers",
    "form_for_save",
    "poison",
    "rebuild_world",
    "store_client",
    "store_host",
]
