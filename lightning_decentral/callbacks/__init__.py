"""Monitors and control for decentralized training, as Lightning callbacks (see the
[monitoring page](../monitoring.md)).

* [`ConsensusDistance`][lightning_decentral.callbacks.ConsensusDistance]: `consensus/distance` `Ξ`,
  `consensus/relative`, `consensus/residual`.
* [`EffectiveLearningRate`][lightning_decentral.callbacks.EffectiveLearningRate]: `lr/effective`,
  `lr/effective_ratio`, `noise/decentralized`.
* [`ConsensusControl`][lightning_decentral.callbacks.ConsensusControl]: extra gossip rounds while `Ξ`
  exceeds a target; `consensus/gossip_steps` (the gossip rounds each step took).
* [`FaultPlan`][lightning_decentral.callbacks.FaultPlan]: ranks kill themselves at the steps it names, once each, to
  test a job's fault tolerance.

They talk to [`DecentralizedStrategy`][lightning_decentral.DecentralizedStrategy] only through its
monitoring surface (`measure_residuals`, `gossip_residual`, `parameter_deviations`, `extra_gossip`,
`averaged_model`, `gossip_rounds`, `topology`), and degrade to the exact single-model values under any
other strategy.
"""

from lightning_decentral.callbacks.consensus import ConsensusDistance
from lightning_decentral.callbacks.control import ConsensusControl
from lightning_decentral.callbacks.effective_lr import EffectiveLearningRate
from lightning_decentral.callbacks.faults import FaultPlan

__all__ = ["ConsensusControl", "ConsensusDistance", "EffectiveLearningRate", "FaultPlan"]
