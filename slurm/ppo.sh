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
# kill); it touches <checkpoint folder>/STOP, every rank sees it at the next step boundary, the run saves,
# leaves STOPPED there and exits 75, and the job requeues itself (same job id, so the run resumes from
# checkpoints/<job> by itself). A signal sent to every process (a pre-emption's TERM, scancel --full) ends
# the same way: torchrun passes TERM and USR1 on to the ranks and gives them TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds to save. trainer.max_runtime stops a run the same way.
# CPU-only nodes: sbatch --gpus-per-node=0 --cpus-per-task=C ... (the command line wins over the lines
# below); the job then runs one process per CPU of its task (GPUS_PER_NODE=k sets the count anywhere).
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

# Processes per node: GPUS_PER_NODE when set, else the GPUs SLURM gave this node, else (a CPU-only
# allocation, --gpus-per-node=0) one per CPU of the task.
GPUS=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}
GPUS=${GPUS##*:}   # --gpus-per-node=a100:8 -> 8
if ! [[ "$GPUS" =~ ^[0-9]+$ ]] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)   # GPUs given as --gres=gpu:k
fi
if [[ "$GPUS" =~ ^[0-9]+$ ]] && [ "$GPUS" -gt 0 ]; then
    DEVICE=GPUs
    GPUS_PER_NODE=${GPUS_PER_NODE:-$GPUS}
else
    DEVICE="CPU processes"
    GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}}
fi
if ! [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: GPUS_PER_NODE=$GPUS_PER_NODE: set it to the number of processes per node (1 or more)" >&2
    exit 2
fi
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
RDZV_PORT=${RDZV_PORT:-29500}
# srun of some SLURM releases (22.05 on) does not take --cpus-per-task over from sbatch: without this,
# torchrun and every rank would share one CPU where tasks are bound to their CPUs.
[ -n "${SLURM_CPUS_PER_TASK:-}" ] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
# The job's end, for trainer.stop_margin_s, where SLURM does not export it (22.05 does not).
if [ -z "${SLURM_JOB_END_TIME:-}" ]; then
    END=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null || true)
    case "$END" in [0-9][0-9][0-9][0-9]-*T*) SLURM_JOB_END_TIME=$(date -d "$END" +%s) && export SLURM_JOB_END_TIME ;; esac
fi

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# InfiniBand / RoCE: set for your fabric (see `ibv_devices`, `ip addr`).
# export NCCL_IB_HCA=mlx5
# export NCCL_IB_GID_INDEX=3
# export NCCL_SOCKET_IFNAME=ib0
# export NCCL_IB_DISABLE=1        # no InfiniBand: fall back to TCP sockets
export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron: keeps TP communication ordered with compute kernels
CPUS=${SLURM_CPUS_PER_TASK:-$((8 * GPUS_PER_NODE))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((CPUS / GPUS_PER_NODE > 0 ? CPUS / GPUS_PER_NODE : 1))}   # threads per rank
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}   # torchrun passes these on
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}   # ... and waits this long for the save
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

# The checkpoint folder the run will use (the last trainer.default_local_dir given wins), for STOP / STOPPED.
CKPT_DIR="checkpoints/$SLURM_JOB_ID"
for arg in "$@"; do
    case "$arg" in trainer.default_local_dir=*) CKPT_DIR=${arg#*=} ;; esac
done
mkdir -p logs "runs/$SLURM_JOB_ID" "$CKPT_DIR"
echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $GPUS_PER_NODE $DEVICE, head $HEAD_NODE:$RDZV_PORT, config $CONFIG"

STOP_FILE="$CKPT_DIR/STOP"
STOPPED_FILE="$CKPT_DIR/STOPPED"
rm -f "$STOP_FILE" "$STOPPED_FILE"  # what ended the previous run of a requeued job
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
trap - USR1 TERM
# torchrun exits 1 when a rank exits 75: STOPPED says the run saved and stopped. A stop requested before the
# run could save (e.g. while it started) requeues too: it resumes from its last checkpoint. A run that ended
# with 0 finished its steps, whatever a late signal touched: nothing to requeue.
if [ "$status" -eq 75 ] || [ -e "$STOPPED_FILE" ] || { [ -e "$STOP_FILE" ] && [ "$status" -ne 0 ]; }; then
    echo "job $SLURM_JOB_ID: stopped ($(cat "$STOPPED_FILE" 2>/dev/null || echo "exit $status, nothing saved")); requeueing"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
