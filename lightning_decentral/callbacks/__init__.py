"""Monitors and control for decentralized training (ALGORITHMS.md §6), as Lightning callbacks.

* :class:`ConsensusDistance`: ``consensus/distance`` ``Ξ``, ``consensus/relative``, ``consensus/residual``.
* :class:`EffectiveLearningRate`: ``lr/effective``, ``lr/effective_ratio``, ``noise/decentralized``.
* :class:`ConsensusControl`: extra gossip rounds while ``Ξ`` exceeds a target; ``consensus/gossip_steps``.

They talk to :class:`~lightning_decentral.DecentralizedStrategy` only through its monitoring surface
(``measure_residuals``, ``gossip_residual``, ``parameter_deviations``, ``extra_gossip``, ``averaged_model``,
``gossip_rounds``, ``topology``), and degrade to the exact single-model values under any other strategy.
"""

from lightning_decentral.callbacks.consensus import ConsensusControl, ConsensusDistance
from lightning_decentral.callbacks.effective_lr import EffectiveLearningRate

__all__ = ["ConsensusControl", "ConsensusDistance", "EffectiveLearningRate"]
