"""`n` decentralized workers in one process:
[`SimulatedDecentralizedStrategy`][lightning_decentral.SimulatedDecentralizedStrategy].

The package: `strategy.py` (the executor: Lightning's hooks, phase by phase over every worker), `replicas.py`
(one device, `x̄`, one shard per worker), `workers.py` (the [`WorkerGroup`][lightning_decentral.simulation.WorkerGroup]
interface and the workers kept apart), `vectorized.py` (every worker as rows of stacked tensors), `isolation.py`
(what `vectorize="auto"`'s trial needs to leave no trace) and `data.py` (worker `i`'s batches from rank `i`'s sampler).
"""

from lightning_decentral.simulation.strategy import SimulatedDecentralizedStrategy
from lightning_decentral.simulation.workers import SimulatedWorkers, WorkerGroup

__all__ = ["SimulatedDecentralizedStrategy", "SimulatedWorkers", "WorkerGroup"]
