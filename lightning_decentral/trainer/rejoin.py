"""What the Trainer's strategy adds for a lost rank that rejoins a run in progress (`rejoin=True`,
[`membership.rejoin`][lightning_decentral.membership.rejoin]): the state a member hands over, and how the rank that
rejoins resumes from it as from a checkpoint, over the network.

The state is this rank's shard (replica, optimizer, precision plugin, every registered part: the outer step's state,
CHOCO's public copies, the random state) as a save writes it
([`make_shard`][lightning_decentral.checkpoint.make_shard]), and what the checkpoint file would hold beside it,
Lightning's: the fit loop's state, the learning-rate schedulers', the callbacks' (the monitors' among them), sent as
tensors and plain data, no pickle
([`hand_over`][lightning_decentral.membership.rejoin.hand_over]). The rank that rejoins loads the replica, and the
Trainer restores the rest after the strategy's setup, as for `fit(ckpt_path=...)`: the loops (the step, the epoch,
the batch), the optimizer, the schedulers, every registered part but the random state
([`take_over_state`][lightning_decentral.trainer.rejoin.take_over_state]). It keeps its own random state and its own
data shard; its callbacks take the source's state over (a `ModelCheckpoint`'s directory, paths and scores: every rank
names each save alike).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_decentral import checkpoint as shards
from lightning_decentral._compat.lightning import callback_states, load_callback_states, resume_from_state
from lightning_decentral.driver import RANDOM_STATE
from lightning_decentral.membership import Join
from lightning_decentral.membership.rejoin import source_for, take_over
from lightning_decentral.topology import Topology


def handover_state(trainer: Trainer, shard: dict[str, Any]) -> dict[str, Any]:
    """What a member hands to a rank that rejoins when step `k` begins: its weights-only `shard` (see the module
    docstring), the fit loop's state as at the end of step `k − 1`, the epoch, the step, the schedulers' and the
    callbacks' state."""
    fit_loop = trainer.fit_loop.state_dict()
    for tracker in fit_loop["epoch_loop.batch_progress"].values():  # as at the end of step k − 1: when step k
        if isinstance(tracker, dict):  # begins, its batch already counts as ready, and the rank that rejoins
            tracker["ready"] = tracker["completed"]  # readies it again (else it validates a step early)
    return {
        "shard": shard,
        "loops": {"fit_loop": fit_loop},
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "callbacks": callback_states(trainer),
    }


def take_over_state(
    trainer: Trainer, decision: Join, first_rank: int, topology: Topology, precision_key: str
) -> dict[str, Any]:
    """A rank that rejoins, admitted, in `setup`, paired with the members' collectives after a join: receive the
    source's state, load the replica, and have the Trainer restore the rest after setup (the precision plugin's state
    under `precision_key`). Returns the shard to resume this rank's registered state from
    ([`taken_over`][lightning_decentral.trainer.rejoin.taken_over])."""
    source = source_for(first_rank, decision.members, decision.joined, topology)
    state = take_over(decision.members.index(source))
    shard = taken_over(state.pop("shard"))
    trainer.lightning_module.load_state_dict(shard["state_dict"])
    resume_from_state(trainer, shards.with_shard(state, shard, precision_key))
    take_over_callbacks(trainer, state["callbacks"])
    return shard


def taken_over(shard: dict[str, Any]) -> dict[str, Any]:
    """The source's `shard` as the rank that rejoins restores it: every registered part but the random state
    (`RANDOM_STATE`), which it keeps, as a worker that comes back in the simulation does (the registry's `load` is
    given `None` for it).

    Examples:
        >>> sorted(taken_over({"state_dict": {}, "gossip": {"bytes_sent": 3}, "rng": {"torch": None}}))
        ['gossip', 'state_dict']
    """
    return {key: value for key, value in shard.items() if key != RANDOM_STATE}


def take_over_callbacks(trainer: Trainer, states: dict[str, dict[str, Any]]) -> None:
    """The callbacks of a rank that rejoins take the source's `states` over
    (`_compat.lightning.callback_states`): a `ModelCheckpoint` first its
    directory (the members agreed on rank 0's when they set up; this rank set up alone), then its paths and scores, so
    that every rank names each save alike (`last.ckpt`, not a `last-v1.ckpt` of its own beside the members')."""
    for callback in trainer.checkpoint_callbacks:
        state = states.get(callback.state_key, {})
        if isinstance(callback, ModelCheckpoint) and state.get("dirpath") is not None:
            callback.dirpath = state["dirpath"]
    load_callback_states(trainer, states)
