"""Local steps with an outer optimizer over gossip: [`OuterStep`][lightning_decentral.outer.OuterStep]
(docs/algorithms.md, "Outer steps")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_decentral.mixing import Mixer, Pending, StartsCopies
from lightning_decentral.options import OptimizerFactory
from lightning_decentral.replicas import Replica
from lightning_decentral.rules import RuleContext, UpdateRule
from lightning_decentral.schedule import StepPlan

LATE_TAG = 1
"""The tag of an overlapped round's exchange, in flight across steps (other exchanges use tag 0)."""


class OuterStep(UpdateRule):
    """Inner steps of the user's optimizer `U`; at the end of each round (steps `k` with `(k + 1) % every == 0`,
    `every = gossip_every = H`), an outer step of the anchor `θ_i` with the mixed models `Σ_j w_ij x_j`:

    ```text
    x_i <- U(x_i, g_i)                                  every step (U keeps its state across rounds)
    Δ̃_i = θ_i − Σ_j w_ij x_j                            at the end of a round: one model sent per neighbour
    θ_i <- OuterOpt(θ_i, Δ̃_i);  x_i <- θ_i              the next round starts from the anchor
    ```

    `Δ̃ = W (θ − x) + (I − W) θ`: the mixed pseudo-gradients plus the anchors' disagreement with their neighbours,
    both under the outer optimizer's momentum. With `W = 11ᵀ/n` (the anchors start and stay equal) it is DiLoCo;
    with `OuterOpt = SGD(lr=1)` it is ATC every `H` steps, `x <- W x`. Mixed module buffers are mixed, `b <- W b`.
    The anchor is taken from the replica when the first step begins (after a resume from `x̄`, from `x̄`). A round
    that ends on a step that exchanges nothing (`W(k) = I`; the survivors' first steps after a failure, or an
    exchange a failure discarded) takes the outer step with `W = I`: `Δ̃_i = θ_i − x_i`. Over compressed gossip
    the mixer sends `C(x_i − x̂_i)` and returns `x̂_i + γ (Σ_j w_ij x̂_j − x̂_i)` from the public copies `x̂`
    ([`Choco`][lightning_decentral.compression.Choco]'s `from_copy`, which the driver sets): `Δ̃_i = θ_i − x̃_i`;
    the copies start at the models every worker starts from, `x̂ = x(0)` (not zero).

    With `overlap`, the round's exchange travels during the next round, whose inner steps go on from the
    models as they were sent, `y_i`; at its end the outer step uses `W y`, and the progress made meanwhile is
    kept on top of the new anchor: `θ_i <- OuterOpt(θ_i, θ_i − Σ_j w_ij y_j)`, `x_i <- θ_i + (x_i − y_i)`
    (buffers: `b_i <- b_i + Σ_j w_ij y_j − y_i`), then the new `x_i` is sent.

    Args:
        replica: the worker's replica, as for every [`UpdateRule`][lightning_decentral.rules.UpdateRule].
        mixer: its mixer.
        optimizer: the user's (inner) optimizer.
        context: what the executor tells the rules.
        outer_optimizer: `parameters -> optimizer`, the outer optimizer of the anchor.
        every: the steps of a round, `H`.
        overlap: apply each round's outer step one round late, its exchange in flight meanwhile.

    Examples:
        DiLoCo with two workers in one process, one inner step per round (`H = 1`), `W = 11ᵀ/2`: from `x = θ = 2`,
        gradients `1` and `2` and `γ = 0.5` give `U(x) = (1.5, 1)`; the outer SGD step with lr `0.5` on
        `Δ̃ = 2 − 1.25` gives `θ = 1.625`, where both workers start the next round.

        >>> import functools
        >>> from lightning_decentral.mixing import DenseMixer
        >>> from lightning_decentral.topology import Complete
        >>> mixer, models = DenseMixer(Complete(world_size=2)), [torch.nn.Linear(1, 1, bias=False) for _ in range(2)]
        >>> rules = []
        >>> for i, model in enumerate(models):
        ...     _ = torch.nn.init.constant_(model.weight, 2.0)
        ...     rules.append(OuterStep(Replica(model, mix_buffers=False), mixer.worker(i),
        ...                            torch.optim.SGD(model.parameters(), lr=0.5), None,
        ...                            outer_optimizer=functools.partial(torch.optim.SGD, lr=0.5), every=1))
        >>> for rule in rules:
        ...     rule.begin_step(StepPlan(step=0, rounds=1))  # the anchor: θ = 2
        >>> for i, (rule, model) in enumerate(zip(rules, models)):
        ...     loss = lambda m=model, i=i: m(torch.ones(1, 1) * (i + 1)).sum().backward()
        ...     _ = rule.optimizer.step(rule.wrap_closure(loss))
        ...     rule.end_step()
        >>> for rule in rules:
        ...     rule.finish_step()
        >>> [model.weight.item() for model in models]
        [1.625, 1.625]
    """

    def __init__(
        self,
        replica: Replica,
        mixer: Mixer,
        optimizer: Optimizer,
        context: RuleContext | None = None,
        *,
        outer_optimizer: OptimizerFactory,
        every: int,
        overlap: bool = False,
    ) -> None:
        super().__init__(replica, mixer, optimizer, context)
        self.every = every
        self.overlap = overlap
        self.anchor = [torch.nn.Parameter(flat.detach().clone()) for flat in replica.flat_parameters]
        for anchor in self.anchor:
            anchor.grad = torch.zeros_like(anchor)  # Δ̃, written at each outer step
        self.outer_optimizer = outer_optimizer(self.anchor)
        check_outer_step(outer_optimizer, self.anchor)
        self._anchored = False  # the anchor is taken from the replica when the first step begins
        self._sent: list[Tensor] = []  # overlap: the models y sent, and W y − y once the exchange is done
        self._change: list[Tensor] = []
        self._late: Pending | None = None  # overlap: the exchange of y, in flight

    def begin_step(self, plan: StepPlan) -> None:
        super().begin_step(plan)
        if not self._anchored:
            with torch.no_grad():
                for anchor, x in zip(self.anchor, self.replica.flat_parameters):
                    anchor.copy_(x)
            if isinstance(self.mixer, StartsCopies):  # compressed: the first message is C(x − x(0)), not C(x)
                self.mixer.start_copies_at(self.replica.mixed, LATE_TAG if self.overlap else 0)
            self._anchored = True

    @property
    def ends_round(self) -> bool:
        """Whether the step begun ends a round: `(k + 1) % every == 0`."""
        return self.plan is not None and (self.plan.step + 1) % self.every == 0

    def end_step(self) -> None:
        assert self.plan is not None
        if not self.ends_round:
            return
        if not self.overlap:
            if self.plan.gossips:
                self._post(self.replica.mixed)  # x <- W x when finish_step waits
            return
        if self._sent:
            self._wait_late()
            self._apply_late()
        self._send_late()

    def finish_step(self) -> None:
        ends_round = self.ends_round and not self.overlap
        super().finish_step()
        if ends_round:
            self._outer_step(self.replica.flat_parameters)
            with torch.no_grad():
                for x, anchor in zip(self.replica.flat_parameters, self.anchor):
                    x.copy_(anchor)

    def drain(self) -> None:
        super().drain()
        self._wait_late()  # its result is kept for the next round's end (or a save)

    def _outer_step(self, mixed: Sequence[Tensor], change: Sequence[Tensor | None] = ()) -> None:
        """`θ <- OuterOpt(θ, θ − x̃)`, `x̃ = mixed + change` (the models as mixed)."""
        with torch.no_grad():
            for i, (anchor, x) in enumerate(zip(self.anchor, mixed)):
                torch.sub(anchor, x, out=anchor.grad)
                if i < len(change):
                    anchor.grad.sub_(change[i])
        self.outer_optimizer.step()

    # -- overlap: the exchange of a round in flight during the next -----------------------------------------

    def _send_late(self) -> None:
        """Post the models as they end this round, `y = x`; the exchange writes `W y − y` into `_change`."""
        assert self.plan is not None
        if not self._sent:
            self._sent = [torch.empty_like(b) for b in self.replica.mixed]
            self._change = [torch.empty_like(b) for b in self.replica.mixed]
        for sent, x in zip(self._sent, self.replica.mixed):
            sent.copy_(x)
        if not self.plan.gossips:  # W = I
            for change in self._change:
                change.zero_()
            return
        self._late = self.mixer.start(self._sent, self.plan.step, self.plan.rounds, tag=LATE_TAG, out=self._change)

    def _wait_late(self) -> None:
        late, self._late = self._late, None
        if late is not None:
            late.wait()

    def _apply_late(self) -> None:
        """The outer step of the round before, with `W y = y + change`; `x <- θ + (x − y)`, `b <- b + change`."""
        parameters = len(self.replica.flat_parameters)
        self._outer_step(self._sent[:parameters], self._change[:parameters])
        with torch.no_grad():
            for x, sent, anchor in zip(self.replica.flat_parameters, self._sent, self.anchor):
                x.sub_(sent).add_(anchor)
            for buffer, change in zip(self.replica.flat_buffers, self._change[parameters:]):
                buffer.add_(change)

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The anchor and the outer optimizer's state; with `overlap`, the models sent and their mixing (the
        exchange in flight is waited for first). One flat tensor per parameter (and mixed buffer), so that a
        stacked simulation's state and a process's are alike
        ([`Replica.split`][lightning_decentral.replicas.Replica.split]). `{}` before the first step."""
        if not self._anchored:
            return {}
        self._wait_late()
        split = self.replica.split
        state: dict[str, Any] = {"anchor": _cloned(split(self.anchor)), "outer_optimizer": self._outer_state()}
        if self._sent:
            state.update(sent=_cloned(split(self._sent)), change=_cloned(split(self._change)))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._late = None
        self._anchored = bool(state)
        self._sent = []
        self._change = []
        if not state:
            self.outer_optimizer.state.clear()
            return
        join = self.replica.join
        with torch.no_grad():
            for anchor, saved in zip(self.anchor, join(state["anchor"])):
                anchor.copy_(saved)
        self._load_outer_state(state["outer_optimizer"])
        if "sent" in state:
            self._sent = [torch.empty_like(b).copy_(t) for b, t in zip(self.replica.mixed, join(state["sent"]))]
            self._change = [torch.empty_like(b).copy_(t) for b, t in zip(self.replica.mixed, join(state["change"]))]

    def _outer_state(self) -> dict[str, Any]:
        """The outer optimizer's `state_dict` with one entry per parameter: per-element state split as the anchor is,
        a scalar (a step count) given to each parameter of its anchor buffer."""
        saved = self.outer_optimizer.state_dict()
        entries = [saved["state"].get(i, {}) for i in range(len(self.anchor))]
        owners = [i for i, _, _ in self.replica.layout() if i < len(self.anchor)]  # each parameter's anchor buffer
        pieces: list[dict[str, Any]] = [{} for _ in owners]
        for name in entries[0]:
            values = [entry[name] for entry in entries]
            per_element = all(_per_element(v, anchor) for v, anchor in zip(values, self.anchor))
            split = self.replica.split(values) if per_element else [values[i] for i in owners]
            for piece, value in zip(pieces, split):
                piece[name] = _cloned(value)
        groups = [{**group, "params": list(range(len(pieces)))} for group in saved["param_groups"]]
        return {"state": dict(enumerate(pieces)) if entries[0] else {}, "param_groups": groups}

    def _load_outer_state(self, saved: dict[str, Any]) -> None:
        """The inverse of `_outer_state`, into the outer optimizer."""
        pieces = [saved["state"][k] for k in sorted(saved["state"])]
        owners = [i for i, _, _ in self.replica.layout() if i < len(self.anchor)]
        entries: list[dict[str, Any]] = [{} for _ in self.anchor]
        for name in pieces[0] if pieces else []:
            values = [piece[name] for piece in pieces]
            if isinstance(values[0], Tensor) and values[0].dim() >= 1:
                joined = [t.view_as(anchor) for t, anchor in zip(self.replica.join(values), self.anchor)]
            else:
                joined = [values[owners.index(i)] for i in range(len(self.anchor))]
            for entry, value in zip(entries, joined):
                entry[name] = value
        groups = [{**group, "params": list(range(len(self.anchor)))} for group in saved["param_groups"]]
        self.outer_optimizer.load_state_dict(
            {"state": dict(enumerate(entries)) if pieces else {}, "param_groups": groups}
        )


def check_outer_step(outer_optimizer: OptimizerFactory, anchor: Sequence[Tensor]) -> None:
    """Refuse, naming the reason and the fix, an outer optimizer that cannot take the outer step: one `step()` (no
    closure) of what `outer_optimizer` builds on copies of `anchor`, each with a dense zero `.grad` (what the outer
    step gives it: `θ − x̃`) must run. LBFGS (it needs a closure) and SparseAdam (sparse gradients) do not.

    Examples:
        >>> import functools
        >>> check_outer_step(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9), [torch.zeros(3)])
        >>> check_outer_step(torch.optim.SparseAdam, [torch.zeros(3)])
        Traceback (most recent call last):
        ...
        ValueError: outer_optimizer builds a SparseAdam, whose step failed on a copy of the model: RuntimeError: ...
    """
    copies = [torch.nn.Parameter(t.detach().clone()) for t in anchor]
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    built = outer_optimizer(copies)
    try:
        built.step()
    except Exception as error:
        raise ValueError(
            f"outer_optimizer builds a {type(built).__name__}, whose step failed on a copy of the model: "
            f"{type(error).__name__}: {error}. The outer step is one step() without a closure from a dense .grad "
            "(the pseudo-gradient θ − x̃): use an optimizer that takes it, such as torch.optim.SGD (lr=0.7, "
            "momentum=0.9, nesterov=True: DiLoCo's), Adam or AdamW; not LBFGS (it needs a closure) or SparseAdam "
            "(sparse gradients)."
        ) from error


def _per_element(value: Any, anchor: Tensor) -> bool:
    """Whether an optimizer state entry holds one value per element of its `anchor` (momentum, Adam's moments)."""
    return isinstance(value, Tensor) and value.dim() >= 1 and value.numel() == anchor.numel()


def _cloned(value: Any) -> Any:
    """`value` (nested dicts and lists) with every tensor copied."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value
