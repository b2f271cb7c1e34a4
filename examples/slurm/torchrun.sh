#!/bin/bash
# Multi-node with torchrun (no SLURM needed): run this script once on EVERY node, e.g.
#
#   NNODES=2 GPUS=8 MASTER=node0.cluster:29500 bash examples/slurm/torchrun.sh            # on each node
#   NNODES=2 GPUS=8 MASTER=node0.cluster:29500 bash examples/slurm/torchrun.sh CONFIG --trainer.max_epochs 10
#
# torchrun starts GPUS processes per node and rendezvouses the nodes at MASTER (host:port of any one
# of them); Lightning's TorchElasticEnvironment reads the ranks it sets. When a rank fails, torchrun
# stops every rank and starts them again, up to MAX_RESTARTS (default 3) times; the CIFAR-10 configs
# then resume from the newest complete checkpoint (`ckpt_path: last`, `resume: newest_complete`).
# The agent that hosts the rendezvous keeps the job's store: if its node dies, the job ends (resubmit
# it; it resumes the same way). Inside a SLURM allocation the same works with one task per node:
#
#   srun --ntasks-per-node=1 env NNODES=$SLURM_JOB_NUM_NODES GPUS=8 \
#       MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):29500 bash examples/slurm/torchrun.sh
set -euo pipefail

: "${NNODES:?set NNODES, the number of nodes}"
: "${GPUS:?set GPUS, the processes (GPUs) per node}"
: "${MASTER:?set MASTER=host:port of the rendezvous (any one node)}"
CONFIG=${1:-examples/configs/cifar10_resnet20_dpsgd.yaml}
shift $(( $# > 0 ? 1 : 0 ))

exec torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$GPUS" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER" \
    --rdzv-id "${RDZV_ID:-lightning-decentral}" \
    --no-python \
    lightning-decentral fit --config "$CONFIG" \
        --trainer.num_nodes "$NNODES" \
        --trainer.devices "$GPUS" \
        "$@"
