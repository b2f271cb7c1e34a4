"""The outside anchor of ``sharded.py``: torchft's ``DiLoCo`` over FSDP2 replica groups, on the same task and network.

torchft is not a dependency of this project: run this script with a Python that has it (``torchft_diloco.py`` says
how) and this repository on ``PYTHONPATH``; as root on Linux.

    PYTHONPATH=$PWD:<the project's site-packages> /tmp/tftvenv/bin/python benchmarks/torchft_sharded.py \
        --profiles 100mbit --methods hsdp,sharded_diloco,torchft_diloco --steps 200 --every 50 --width 192 --layers 4
    ... benchmarks/torchft_sharded.py --smoke

The options are ``sharded.py``'s, with one more method, ``torchft_diloco``, run as the others are (8 fresh processes on
the same emulated network, after them: ratios against ``hsdp`` in the same run). Each host is one replica group of 2
ranks: the model is ``sharded.py``'s, seeded the same, its blocks and root sharded with FSDP2 over the host's two ranks
(a 2-D mesh over the 8 ranks' process group, its ``shard`` dimension: the group's own "world"); each rank runs a
``torchft.Manager`` (group rank 0 or 1 of a group of 2, ``ProcessGroupGloo`` across the groups: rank ``j`` of every host
all-reduces its shard ``j`` of the pseudo-gradient), host 0 also the lighthouse; ``DiLoCo`` wraps the same inner AdamW
and outer Nesterov SGD with ``sync_every = H``, around a plain loop over the sampler Lightning would give the rank. The
replicas start from the same seeded weights with ``init_sync=False`` (as in ``torchft_diloco.py``). Every ``H`` steps,
right after the outer step, both ranks of a host evaluate the model on all validation windows (training time excludes
it).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import harness
import lightning.pytorch as pl
import sharded
import torch
from torchft_diloco import epochs, managed


def torchft_diloco(spec: dict[str, Any], data: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """One rank of one replica group (host ``rank // 2``): DiLoCo's loop over an FSDP2-sharded model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft.local_sgd import DiLoCo

    config, addresses = spec["config"], spec["addresses"]
    host, group_rank, hosts = rank // sharded.SHARD, rank % sharded.SHARD, world_size // sharded.SHARD
    if not torch.distributed.is_initialized():  # Lightning leaves its process group up after fit: this is for --methods
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    pl.seed_everything(0, verbose=False)  # as sharded.py's jobs: the same initial weights and data order
    model = sharded.GPT(config["context"], config["width"], config["layers"])
    mesh = init_device_mesh("cpu", (hosts, sharded.SHARD), mesh_dim_names=("replicate", "shard"))["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)  # ShardedLM's
    outer_optimizer = sharded.outer_optimizer(config)(model.parameters())  # sharded_diloco's
    batches = epochs(data["train"], config["batch"], world_size, rank)
    val = data["val"].split(config["batch"])
    total, every = sharded.method_steps("torchft_diloco", config), config["every"]

    def loss(window: torch.Tensor) -> torch.Tensor:
        logits = model(window[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))

    times, points, held = [], [], 0
    with (
        managed(model, addresses, host, group_rank, group_size=sharded.SHARD, hosts=hosts) as manager,
        DiLoCo(
            manager,
            [model],
            inner,
            outer_optimizer,
            sync_every=every,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        ),
    ):
        for step, (window,) in enumerate(batches, start=1):
            started = time.perf_counter()
            inner.zero_grad()
            loss(window).backward()
            inner.step()  # DiLoCo's hook: every H steps the pseudo-gradient shards all-reduced, the outer step
            times.append(time.perf_counter() - started)
            held = held or sharded.held_bytes(model, inner)
            if step % every == 0:
                with torch.no_grad():
                    value = statistics.fmean(float(loss(w)) for w in val)
                points.append({"step": step, "seconds": sum(times), "loss": value})
            if step == total:
                break
    timed = times[config["warmup"] :] or times
    return {"held": held, "step_median": statistics.median(timed), "points": points}


if __name__ == "__main__":
    harness.exit_on_sigterm()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum otherwise
    sys.exit(sharded.main(None, jobs={"torchft_diloco": torchft_diloco}, script=__file__, doc=__doc__))
