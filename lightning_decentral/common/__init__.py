"""What two or three of the executors share, with Lightning (below `trainer/`, `fabric/` and `simulation/`, which
import nothing from each other; what all three share without Lightning is the [driver][lightning_decentral.driver]):

* [`processes`][lightning_decentral.common.processes]: what the Trainer's and Fabric's strategies on processes hold
  (`Processes`): their default process group on this generation's namespace of the job's store, their mixer and
  survivors, a lost rank's way back;
* [`checkpoints`][lightning_decentral.common.checkpoints]: their shards (`ShardedCheckpoints`);
* [`evaluation`][lightning_decentral.common.evaluation]: evaluation on `x̄` (the Trainer's strategy and the
  simulation), whether communication may overlap backward, the rules' grad scaler.
"""

from lightning_decentral.common.checkpoints import ShardedCheckpoints
from lightning_decentral.common.evaluation import EvaluationOnAverage, backward_may_overlap, enabled_grad_scaler
from lightning_decentral.common.processes import Processes, init_default_group, launched_by_lightning

__all__ = [
    "EvaluationOnAverage",
    "Processes",
    "ShardedCheckpoints",
    "backward_may_overlap",
    "enabled_grad_scaler",
    "init_default_group",
    "launched_by_lightning",
]
