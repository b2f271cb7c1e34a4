"""lightning-decentral: decentralized (gossip) training for PyTorch Lightning.

`import lightning_decentral` registers the strategies, after which
`Trainer(strategy="dpsgd")` trains any LightningModule decentralized, `Fabric(strategy="dpsgd")`
a hand-written loop ([`lightning_decentral.fabric`][lightning_decentral.fabric]), and
`Trainer(strategy="dpsgd_sim", devices=1)` simulates the same run in one process.
"""

import logging
import warnings

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_decentral import fabric
from lightning_decentral.data import DirichletSampler
from lightning_decentral.mixing import DelaySchedule, RandomDelays
from lightning_decentral.simulation import SimulatedDecentralizedStrategy
from lightning_decentral.topology import (
    TOPOLOGIES,
    Complete,
    Exponential,
    GraphTopology,
    Hierarchical,
    MatrixTopology,
    OnePeerExponential,
    OnePeerRing,
    RandomMatching,
    Ring,
    Topology,
    Torus,
)
from lightning_decentral.trainer import DecentralizedStrategy

__version__ = "0.1.0"

# The package's messages (a worker lost, a step agreed) are shown as Lightning's are: INFO and above on stderr, unless
# the application configured logging itself (the root logger has handlers: they get them).
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

# Third-party messages that tell a user of the package nothing, dropped where they arise (nothing else is touched):
# torch's FutureWarning about the `LeafSpec()` Lightning's own code makes (once per process, every rank), and
# Lightning's INFO "`weights_only` was not set, defaulting to `False`." at a save that does not say, as
# OnExceptionCheckpoint's on a SIGTERM stop (every rank: once per rank).
warnings.filterwarnings(
    "ignore",
    message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree",
)
logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector").addFilter(
    lambda record: not record.getMessage().startswith("`weights_only` was not set")
)

DecentralizedStrategy.register_strategies(StrategyRegistry)
SimulatedDecentralizedStrategy.register_strategies(StrategyRegistry)
fabric.DecentralizedStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = [
    "TOPOLOGIES",
    "Complete",
    "DecentralizedStrategy",
    "DelaySchedule",
    "DirichletSampler",
    "Exponential",
    "GraphTopology",
    "Hierarchical",
    "MatrixTopology",
    "OnePeerExponential",
    "OnePeerRing",
    "RandomDelays",
    "RandomMatching",
    "Ring",
    "SimulatedDecentralizedStrategy",
    "Topology",
    "Torus",
]
