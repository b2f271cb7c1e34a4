"""What every test starts from."""

import os

import pytest


def _forget_the_global_seed() -> None:
    os.environ.pop("PL_GLOBAL_SEED", None)


@pytest.fixture(autouse=True, scope="module")
def no_global_seed_in_module():
    """A module's own fixtures start without a `PL_GLOBAL_SEED` (autouse: set up before them)."""
    _forget_the_global_seed()
    yield
    _forget_the_global_seed()


@pytest.fixture(autouse=True)
def no_global_seed():
    """Each test starts without an earlier test's or fixture's `seed_everything`: Lightning seeds every
    `DistributedSampler` (and a process the test starts) from the `PL_GLOBAL_SEED` it leaves in `os.environ`."""
    _forget_the_global_seed()
    yield
    _forget_the_global_seed()
