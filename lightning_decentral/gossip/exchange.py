"""[`PendingGossip`][lightning_decentral.gossip.PendingGossip]: one exchange of a
[`Gossip`][lightning_decentral.gossip.Gossip] in flight, its rounds and levels, and what becomes of it when a peer
fails."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from lightning_decentral.failures import PeerFailure, Survival, peers_answer, wait_works
from lightning_decentral.mixing import ExchangeEvent, ExchangeObserver, notify_post, notify_wait
from lightning_decentral.topology import Topology


class Leg(Protocol):
    """What an exchange asks of the engine that starts it and of each leg of a round (the engine itself, or a level
    of a hierarchical topology): what [`Gossip`][lightning_decentral.gossip.Gossip] provides."""

    topology: Topology
    generation: int

    @property
    def observers(self) -> list[ExchangeObserver]: ...

    @property
    def measure_residuals(self) -> bool: ...

    @property
    def survival(self) -> Survival | None: ...

    def legs(self, step: int) -> list[Leg]: ...

    def neighbour_names(self, step: int) -> list[str]: ...

    def post(self, buffers: Sequence[Tensor], step: int, tag: int) -> tuple[list[dist.Work], list[int | None]]: ...

    def combine(
        self,
        buffers: Sequence[Tensor],
        step: int,
        tag: int,
        measure: bool = False,
        into: Sequence[Tensor] | None = None,
    ) -> list[Tensor]: ...


class PendingGossip:
    """An exchange in flight; `wait()` completes it and combines.

    After `wait()`, `residuals` holds, when the engine measures them, one 0-dim tensor per
    buffer: `‖x_i − Σ_j w_ij x_j‖²` of the first round, on this rank (no host sync); `None`
    when nothing was exchanged or nothing was measured. In low precision it is `‖q_i − Σ_j w_ij q_j‖²`,
    the update the exchange applied.

    When a peer fails and the engine has a [`Survival`][lightning_decentral.failures.Survival]
    (`on_peer_failure="continue"`), the exchange is *discarded*: the first one of a generation to see the failure
    has the survivors agree and rebuild (`survival.survive`), and every exchange of that generation not completed
    ends as if `W = I`: the buffers keep what was posted (restored where an all-reduce or an earlier round had
    written them) and `out` holds zeros.
    """

    def __init__(
        self,
        gossip: Leg,
        buffers: Sequence[Tensor],
        step: int,
        rounds: int,
        tag: int,
        out: Sequence[Tensor] | None = None,
        event: ExchangeEvent | None = None,
    ) -> None:
        self._gossip = gossip
        self._generation = gossip.generation
        self._step = step
        self._tag = tag
        self._observers = list(gossip.observers)
        self._event = event
        self._buffers = list(buffers)
        self._out = None if out is None else list(out)
        per_round = gossip.legs(step) if rounds else []
        self._legs = per_round * rounds
        self._first_round = len(per_round)
        self._done = 0
        self.residuals: list[Tensor] | None = None
        self._measure = gossip.measure_residuals and bool(self._legs)
        # out=: a point-to-point first exchange reads the buffers directly; anything else runs on a copy in out
        self._direct = self._out is not None and bool(self._legs) and not self._legs[0].topology.is_average(step)
        if self._out is not None and not self._direct:
            for o, b in zip(self._out, self._buffers):
                o.copy_(b)
        self._current = self._buffers if self._out is None or self._direct else self._out
        single_p2p = self._first_round == 1 and not per_round[0].topology.is_average(step) if per_round else False
        self._before = [c.clone() for c in self._current] if self._measure and not single_p2p else None
        # a survivor restores buffers that an all-reduce or an earlier round writes before the exchange completes
        writes_early = self._out is None and bool(self._legs) and (len(self._legs) > 1 or not single_p2p)
        self._posted = [b.clone() for b in self._buffers] if gossip.survival is not None and writes_early else None
        self._what = f"The gossip exchange of step {step}"
        names = gossip.neighbour_names(step)
        self._peers = (
            "another rank (this exchange is an all-reduce of every rank)"
            if names == ["every rank"]
            else (f"a neighbour ({', '.join(names) or 'none'})")
        )
        self._works = None
        self._ranks = []
        if self._legs:
            self._post(self._legs[0])
        notify_post(self._observers, event)

    def wait(self) -> None:
        """Block until the buffers hold `W(step)^rounds x` (with `out=`: `out` holds that minus `x`)."""
        started = time.perf_counter()
        self._complete()
        notify_wait(self._observers, self._event, started)
        self._event = None  # reported once

    def _post(self, leg: Leg) -> None:
        try:
            with peers_answer(self._what, self._peers):  # a peer already gone fails the post itself
                self._works, self._ranks = leg.post(self._current, self._step, self._tag)
        except PeerFailure as failure:
            self._give_up(failure)

    def _complete(self) -> None:
        while self._works is not None:
            if self._generation != self._gossip.generation:  # the survivors went on: this one is stale
                self._give_up(None)
                return
            survival = self._gossip.survival
            try:
                wait_works(self._works, survival and survival.poll, self._what, self._peers, self._ranks)
            except PeerFailure as failure:
                self._give_up(failure)
                return
            leg = self._legs[self._done]
            if self._direct and self._done == 0:
                residuals = leg.combine(self._buffers, self._step, self._tag, self._measure, into=self._out)
                self._current = self._out
                if len(self._legs) > 1:  # later exchanges mix W x itself
                    for o, b in zip(self._out, self._buffers):
                        o.add_(b)
            else:
                residuals = leg.combine(self._current, self._step, self._tag, self._measure)
            self._done += 1
            if self._measure and self._done == self._first_round and self.residuals is None:
                if self._before is None:
                    self.residuals = residuals
                else:
                    self.residuals = [(c - x).square().sum() for c, x in zip(self._current, self._before)]
                    self._before = None
            if self._done < len(self._legs):
                self._post(self._legs[self._done])
                continue
            self._works = None
            if self._out is not None and not (self._direct and len(self._legs) == 1):
                for o, b in zip(self._out, self._buffers):
                    o.sub_(b)

    def _give_up(self, failure: PeerFailure | None) -> None:
        """Discard this exchange (`W = I`); the first failure of a generation first has the survivors agree and
        rebuild. Without a survival, the failure is the run's error."""
        survival = self._gossip.survival
        if failure is not None and survival is None:
            raise failure
        if failure is not None and self._generation == self._gossip.generation:
            survival.survive(self._step, failure)
        self._works = None
        self.residuals = None
        if self._posted is not None:
            for b, posted in zip(self._buffers, self._posted):
                b.copy_(posted)
        for o in self._out or []:
            o.zero_()
