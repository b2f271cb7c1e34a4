"""What a run that survived failures says about them: the line every survivor logs per decision
([`decision_line`][lightning_decentral.membership.report.decision_line]), the metrics
([`survivor_metrics`][lightning_decentral.membership.report.survivor_metrics]) and the warning at the end
([`losses`][lightning_decentral.membership.report.losses]).

The lines go to the logger `lightning_decentral`, which `import lightning_decentral` sets up as Lightning sets up its
own (level INFO, printed to stderr unless the root logger has handlers): `logging.getLogger("lightning_decentral")`
silences or redirects them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_decentral.membership.protocol import Decision, Join


def decision_line(decision: Decision, first_rank: int, topology: Any) -> str:
    """The line a survivor logs once it has adopted `decision` (`first_rank`: its rank at the start; `topology`: the
    survivors' graph).

    Examples:
        >>> decision = Decision(generation=1, members=(0, 1, 3), survivors=(0, 1, 3), lost=(2,), step=20)
        >>> decision_line(decision, 3, "Ring(world_size=3)")
        'Survived failure 1: lost rank 2 (ranks of the start). The 3 survivors [0, 1, 3] agreed on step 20: they take
        it alone and mix again from step 21 on Ring(world_size=3). This process: rank 3 of the start, rank 2 now.'
    """
    if isinstance(decision, Join):
        return (
            f"Rejoined (generation {decision.generation}): rank{'s' if len(decision.joined) > 1 else ''} "
            f"{', '.join(map(str, decision.joined))} of the "
            f"start{f', lost {list(decision.lost)}' if decision.lost else ''}. The {len(decision.members)} members "
            f"{list(decision.members)} mix from step {decision.step + 1} on {topology}. This process: rank "
            f"{first_rank} of the start, rank {decision.members.index(first_rank)} now."
        )
    lost = ", ".join(map(str, decision.lost))
    return (
        f"Survived failure {decision.generation}: lost rank{'s' if len(decision.lost) > 1 else ''} {lost} (ranks of "
        f"the start). The {len(decision.members)} survivors {list(decision.members)} agreed on step {decision.step}: "
        f"they take it alone and mix again from step {decision.step + 1} on {topology}. This process: rank "
        f"{first_rank} of the start, rank {decision.members.index(first_rank)} now."
    )


def survivor_metrics(decisions: Sequence[Decision], world_size: int) -> dict[str, float]:
    """`survivors/workers`: the workers training now; `survivors/lost`: the workers lost so far (`world_size`: the
    workers now).

    Examples:
        >>> survivor_metrics([Decision(1, (0, 1, 3), (0, 1, 3), (2,), 20)], 3)
        {'survivors/workers': 3.0, 'survivors/lost': 1.0}
    """
    return {"survivors/workers": float(world_size), "survivors/lost": float(sum(len(d.lost) for d in decisions))}


def losses(decisions: Sequence[Decision]) -> str | None:
    """The warning at the end of a run that lost workers (`None` if it lost none).

    Examples:
        >>> losses([Decision(1, (1, 2), (1, 2), (0,), 10), Decision(2, (2,), (1,), (1,), 20)])
        'This run lost 2 of its 3 workers: rank 0 (the survivors agreed on step 10), rank 1 (step 20). It went on
        with 1 (strategy.failures_survived lists the decisions).'
    """
    first = decisions[0] if decisions else None
    started = (
        len(first.members) + len(first.lost) - (len(first.joined) if isinstance(first, Join) else 0) if first else 0
    )
    decisions = [d for d in decisions if d.lost]  # a join loses nobody (unless a rank was lost meanwhile)
    if not decisions:
        return None
    lost = [
        f"rank{'s' if len(d.lost) > 1 else ''} {', '.join(map(str, d.lost))} "
        + (f"(the survivors agreed on step {d.step})" if i == 0 else f"(step {d.step})")
        for i, d in enumerate(decisions)
    ]
    gone = sum(len(d.lost) for d in decisions)
    return (
        f"This run lost {gone} of its {started} workers: {', '.join(lost)}. It went on with "
        f"{len(decisions[-1].members)} (strategy.failures_survived lists the decisions)."
    )
