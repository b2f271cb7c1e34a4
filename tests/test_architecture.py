"""The architecture's promises that no other test states (docs/architecture.md): the update-rule arguments are
ordinary members of the executors' shared surface, one per field of `GossipOptions`."""

from __future__ import annotations

from dataclasses import fields

from lightning_decentral.driver import Driven, StepDriver
from lightning_decentral.options import GossipOptions


class _Executor(Driven):
    def __init__(self, options: GossipOptions) -> None:
        self.driver = StepDriver(options)


def test_every_option_is_a_property_of_driven_with_the_options_value() -> None:
    options = GossipOptions(combine="atc", gossip_every=3, compression="sign")
    executor = _Executor(options)
    for field in fields(GossipOptions):
        if field.name == "topology":  # Driven.topology is the bound one
            continue
        assert isinstance(vars(Driven).get(field.name), property), field.name
        assert getattr(executor, field.name) == getattr(options, field.name), field.name
    assert executor.bytes_sent == 0
