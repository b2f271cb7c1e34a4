"""What a run that survived failures says about them: the line every survivor logs per decision
([`decision_line`][lightning_decentral.membership.report.decision_line]), the metrics
([`survivor_metrics`][lightning_decentral.membership.report.survivor_metrics]) and the line at the end
([`losses`][lightning_decentral.membership.report.losses]), which one rank logs.

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


def survivor_metrics(started: int, world_size: int) -> dict[str, float]:
    """`survivors/workers`: the workers training now; `survivors/lost`: the workers of the start missing now
    (`started − world_size`: a rank that rejoined counts again). Every rank knows both, a rank that rejoined too, so
    every rank logs the same values.

    Examples:
        >>> survivor_metrics(4, 3), survivor_metrics(4, 4)
        ({'survivors/workers': 3.0, 'survivors/lost': 1.0}, {'survivors/workers': 4.0, 'survivors/lost': 0.0})
    """
    return {"survivors/workers": float(world_size), "survivors/lost": float(started - world_size)}


def losses(decisions: Sequence[Decision]) -> str | None:
    """The line at the end of a run that lost workers (`None` if it lost none): what was lost, what rejoined, and the
    workers it ended with.

    Examples:
        >>> losses([Decision(1, (1, 2), (1, 2), (0,), 10), Decision(2, (2,), (1,), (1,), 20)])
        'This run lost 2 of its 3 workers: rank 0 (the survivors agreed on step 10), rank 1 (step 20). It ended
        with 1 (strategy.failures_survived lists the decisions).'
        >>> failure = Decision(1, (0, 1, 3), (0, 1, 3), (2,), 10)
        >>> losses([failure, Join(2, (0, 1, 2, 3), (0, 1, 2, 3), (), 29, joined=(2,))])
        'This run lost 1 of its 4 workers: rank 2 (the survivors agreed on step 10). Rank 2 rejoined (from step
        30). It ended with 4 (strategy.failures_survived lists the decisions).'
    """
    first = decisions[0] if decisions else None
    started = (
        len(first.members) + len(first.lost) - (len(first.joined) if isinstance(first, Join) else 0) if first else 0
    )
    failures = [d for d in decisions if d.lost]  # a join loses nobody (unless a rank was lost meanwhile)
    if not failures:
        return None
    lost = [
        f"rank{'s' if len(d.lost) > 1 else ''} {', '.join(map(str, d.lost))} "
        + (f"(the survivors agreed on step {d.step})" if i == 0 else f"(step {d.step})")
        for i, d in enumerate(failures)
    ]
    joins = [d for d in decisions if isinstance(d, Join) and d.joined]
    rejoined = "; ".join(
        f"{'Ranks' if len(d.joined) > 1 else 'Rank'} {', '.join(map(str, d.joined))} rejoined (from step {d.step + 1})"
        for d in joins
    )
    gone = sum(len(d.lost) for d in failures)
    return (
        f"This run lost {gone} of its {started} workers: {', '.join(lost)}. {rejoined + '. ' if rejoined else ''}"
        f"It ended with {len(decisions[-1].members)} (strategy.failures_survived lists the decisions)."
    )


def says_losses(decisions: Sequence[Decision], first_rank: int) -> bool:
    """Whether the rank `first_rank` (its rank at the start), which adopted `decisions`, logs the line at the end
    ([`losses`][lightning_decentral.membership.report.losses]): the first of the last members that never left. A
    rank that rejoined adopted only the decisions since (its first is not generation 1), so it never does; every rank
    that never left knows every decision, and each finds the same one rank.

    Examples:
        >>> failure = Decision(1, (1, 2, 3), (1, 2, 3), (0,), 10)
        >>> join = Join(2, (0, 1, 2, 3), (0, 1, 2, 3), (), 29, joined=(0,))
        >>> [says_losses([failure, join], rank) for rank in (1, 2)], says_losses([join], 0)
        ([True, False], False)
    """
    if not decisions or decisions[0].generation != 1:
        return False
    rejoined = {rank for d in decisions if isinstance(d, Join) for rank in d.joined}
    stayed = [rank for rank in decisions[-1].members if rank not in rejoined]
    return bool(stayed) and stayed[0] == first_rank
