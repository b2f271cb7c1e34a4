"""The option lists cannot drift from [`GossipOptions`], the one list of the update-rule arguments: its docstring (the
Options page of the API reference renders it) describes every field, and each executor's docstring names every one."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from lightning_decentral import DecentralizedStrategy, SimulatedDecentralizedStrategy
from lightning_decentral.fabric import DecentralizedStrategy as FabricStrategy
from lightning_decentral.options import GossipOptions

OPTIONS = [field.name for field in fields(GossipOptions)]


def test_the_options_page_describes_every_field_in_order() -> None:
    args = GossipOptions.__doc__.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    described = re.findall(r"^ {8}(\w+): ", args, flags=re.MULTILINE)
    assert described == OPTIONS


@pytest.mark.parametrize("executor", [DecentralizedStrategy, FabricStrategy, SimulatedDecentralizedStrategy])
def test_each_executor_names_every_option(executor: type) -> None:
    missing = [name for name in OPTIONS if f"`{name}`" not in executor.__doc__]
    assert not missing, f"{executor.__module__}.{executor.__name__}'s docstring does not name {missing}"
