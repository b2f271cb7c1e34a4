"""What every test starts from."""

import os

import pytest


@pytest.fixture(autouse=True)
def no_global_seed():
    """Each test starts without an earlier test's `seed_everything`: Lightning seeds every `DistributedSampler` (and
    a worker process started by the test) from the `PL_GLOBAL_SEED` it leaves in `os.environ`."""
    before = os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)
    if before is not None:
        os.environ["PL_GLOBAL_SEED"] = before
