"""lightning-decentral: decentralized (gossip) training for PyTorch Lightning.

`import lightning_decentral` registers the strategies, after which
`Trainer(strategy="dpsgd")` trains any LightningModule decentralized, and
`Trainer(strategy="dpsgd_sim", devices=1)` simulates the same run in one process.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_decentral.simulation import SimulatedDecentralizedStrategy
from lightning_decentral.strategy import DecentralizedStrategy
from lightning_decentral.topology import (
    TOPOLOGIES,
    Complete,
    Exponential,
    GraphTopology,
    Hierarchical,
    MatrixTopology,
    OnePeerExponential,
    Ring,
    Topology,
    Torus,
)

__version__ = "0.1.0"

DecentralizedStrategy.register_strategies(StrategyRegistry)
SimulatedDecentralizedStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "TOPOLOGIES",
    "Complete",
    "DecentralizedStrategy",
    "Exponential",
    "GraphTopology",
    "Hierarchical",
    "MatrixTopology",
    "OnePeerExponential",
    "Ring",
    "SimulatedDecentralizedStrategy",
    "Topology",
    "Torus",
]
