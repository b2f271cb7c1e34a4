"""The fast loop's marks: `python -m pytest -m "not slow"` leaves out what is marked `slow` (pyproject.toml)."""

from __future__ import annotations

from typing import Any

import pytest


def slow_cases(cases: list[Any], slow: set[str]) -> list[Any]:
    """`cases` (configs, or tuples whose first item is the config) for `pytest.mark.parametrize`, the configs named in
    `slow` marked slow: each takes more than ~2 s on 2 cores. A name in `slow` that no case has is an error, so a
    renamed case cannot leave the fast loop's cut silently."""

    def name(case: Any) -> str:
        return (case[0] if isinstance(case, tuple) else case).name

    unknown = slow - {name(case) for case in cases}
    assert not unknown, f"slow names cases that do not exist: {sorted(unknown)}"
    marks = {True: [pytest.mark.slow], False: []}
    return [
        pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=marks[name(case) in slow]) for case in cases
    ]
