"""Local steps with an outer optimizer over gossip (DiLoCo without an all-reduce; DiLoCo itself on the complete graph):
the update rule [`OuterStep`][lightning_decentral.outer.OuterStep], which the
[driver][lightning_decentral.driver.StepDriver.make_rule] builds when `outer_optimizer` is set."""

from lightning_decentral.outer.rule import LATE_TAG, OuterStep

__all__ = ["LATE_TAG", "OuterStep"]
