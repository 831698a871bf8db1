#!/bin/bash
# GRPO of Qwen3-30B-A3B (MoE) on GSM8k with routing replay: 2 nodes x 8 x 80 GB GPUs, experts split over
# the 8 GPUs of each node, one pipeline stage per node (the layout in configs/qwen3_30b_a3b.yaml).
#
#   mkdir -p logs && sbatch slurm/ppo_qwen3_30b_a3b.sh [key=value ...]
#
# Set model.path / data.tokenizer in the config (or as overrides) to the HF Qwen3-30B-A3B folder.
#SBATCH --job-name=grpo-qwen3-30b-a3b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
set -euo pipefail

# sbatch runs a copy of this script from its spool folder: find the repository from the submit folder.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}
export REPO_DIR
exec bash "$REPO_DIR/slurm/ppo.sh" configs/qwen3_30b_a3b.yaml "$@"
