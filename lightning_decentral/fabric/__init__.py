"""Decentralized training in a hand-written Lightning Fabric loop: `Fabric(strategy="dpsgd")`.

The usual loop trains decentralized; the whole update rule of
[`lightning_decentral.rules`][lightning_decentral.rules] runs inside `optimizer.step()`:

```text
model(x)              forward pre-hook: plan = schedule.plan(k); rule.begin_step(plan)    AWC posts x(k)
fabric.backward(loss) rule.before_backward(), then backward                              DecentLaM posts buckets
optimizer.step()      rule.wrap_closure(...); U; rule.end_step(); rule.finish_step(); k += 1
```

`k` counts the optimizer steps of this strategy and is saved with every checkpoint. Launching,
cluster environments, samplers, `barrier`, `broadcast` and `all_reduce` are Fabric's `DDPStrategy`'s;
the module is never wrapped in `DistributedDataParallel`. See the [Fabric page](../fabric.md).
"""

from lightning_decentral.fabric.checkpoints import STEP_KEY, PrefixedModule, under_prefix
from lightning_decentral.fabric.convert import to_trainer_checkpoint
from lightning_decentral.fabric.data import DataOrder
from lightning_decentral.fabric.monitors import consensus_metrics, effective_lr_metrics, gossip_metrics
from lightning_decentral.fabric.strategy import DecentralizedStrategy

__all__ = [
    "STEP_KEY",
    "DataOrder",
    "DecentralizedStrategy",
    "PrefixedModule",
    "consensus_metrics",
    "effective_lr_metrics",
    "gossip_metrics",
    "to_trainer_checkpoint",
    "under_prefix",
]
