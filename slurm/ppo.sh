#!/bin/bash
# Generic multi-node PPO/GRPO job: one srun task per node, each running torchrun over its GPUs;
# torchrun's c10d rendezvous on the first node wires them into one world of nodes x GPUs ranks.
#
#   mkdir -p logs && sbatch --nodes=4 slurm/ppo.sh configs/qwen2_72b.yaml [key=value ...]
#
# Split placement (rollout on whole nodes of its own, e.g. 1 of 4): ROLLOUT_NODES=1 sbatch --nodes=4 ...,
# which adds placement.mode=split placement.rollout_world_size=<ROLLOUT_NODES x GPUs per node>; torchrun
# numbers each node's GPUs consecutively, so the last ranks are whole nodes. Add
# async_training.staleness_threshold=1 for one-step off-policy training.
# Check the layout first: python scripts/plan_layout.py --config CONFIG --nodes N [--placement auto].
# Activate the Python environment before sbatch (SLURM exports it). Logs, TensorBoard events and
# checkpoints go to per-job folders; resume a job with trainer.default_local_dir=checkpoints/<old id>.
#SBATCH --job-name=hybridrl-ppo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch [--nodes=N] slurm/ppo.sh configs/X.yaml [key=value ...]}
shift

# sbatch runs a copy of this script from its spool folder: work from where the job was submitted.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO_DIR"

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
RDZV_PORT=${RDZV_PORT:-29500}

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# InfiniBand / RoCE: set for your fabric (see `ibv_devices`, `ip addr`).
# export NCCL_IB_HCA=mlx5
# export NCCL_IB_GID_INDEX=3
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_IB_DISABLE=1        # no InfiniBand: fall back to TCP sockets
export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron: keeps TP communication ordered with compute kernels
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}   # CPU threads per rank (cpus-per-task / GPUs)
export PYTHONUNBUFFERED=1              # log lines reach logs/%x-%j.out as they happen

PLACEMENT=()
ROLLOUT_NODES=${ROLLOUT_NODES:-0}
if [ "$ROLLOUT_NODES" -gt 0 ]; then
    if [ "$ROLLOUT_NODES" -ge "$SLURM_NNODES" ]; then
        echo "error: ROLLOUT_NODES=$ROLLOUT_NODES leaves no node to train on $SLURM_NNODES node(s); ask for more nodes" >&2
        exit 2
    fi
    PLACEMENT=(placement.mode=split "placement.rollout_world_size=$((ROLLOUT_NODES * GPUS_PER_NODE))")
fi

mkdir -p logs "runs/$SLURM_JOB_ID" "checkpoints/$SLURM_JOB_ID"
echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $GPUS_PER_NODE GPUs, head $HEAD_NODE:$RDZV_PORT, config $CONFIG"

# Per-job folders first, so overrides given on the command line ("$@") win.
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv_id="$SLURM_JOB_ID" \
    scripts/train_ppo.py --config "$CONFIG" \
    trainer.log_dir="runs/$SLURM_JOB_ID" trainer.default_local_dir="checkpoints/$SLURM_JOB_ID" \
    "${PLACEMENT[@]}" "$@"
