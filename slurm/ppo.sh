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
# Preemption and time limits: SLURM signals this batch shell (USR1 300 s before the end, TERM before a
# kill); it touches checkpoints/<job>/STOP, every rank sees it at the next step boundary, the run saves and
# exits 75, and the job requeues itself (same job id, so the run resumes from checkpoints/<job> by itself).
# Activate the Python environment before sbatch (SLURM exports it). Logs, TensorBoard events and
# checkpoints go to per-job folders; resume a job with trainer.default_local_dir=checkpoints/<old id>.
#SBATCH --job-name=hybridrl-ppo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
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

STOP_FILE="checkpoints/$SLURM_JOB_ID/STOP"
trap 'echo "job $SLURM_JOB_ID: stop requested, saving at the next step"; touch "$STOP_FILE"' USR1 TERM

# Per-job folders first, so overrides given on the command line ("$@") win.
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv_id="$SLURM_JOB_ID" \
    scripts/train_ppo.py --config "$CONFIG" \
    trainer.log_dir="runs/$SLURM_JOB_ID" trainer.default_local_dir="checkpoints/$SLURM_JOB_ID" \
    "${PLACEMENT[@]}" "$@" &
RUN=$!
status=0
while true; do  # a trapped signal interrupts `wait`; keep waiting for the run to save and end
    wait "$RUN" && status=0 || status=$?
    kill -0 "$RUN" 2>/dev/null || break
done
if [ "$status" -eq 75 ] || [ -e "$STOP_FILE" ]; then
    echo "job $SLURM_JOB_ID: saved and stopped (exit $status); requeueing"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
