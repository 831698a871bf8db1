#!/usr/bin/env bash
# hybridrl's first GPU run: one unattended pass over the CUDA paths, under 8 minutes on one H200.
#
#   benchmarks/gpu_check.sh                 on the GPU machine, in the repository root's copy
#   benchmarks/gpu_check.sh --smoke         the same stages at tiny sizes on CPU (checks this script)
#   benchmarks/gpu_check.sh --fetch-wheels  here, with network: the wheels the GPU image lacks, into .whl/
#
# The GPU image has torch 2.11 + CUDA 13 on Python 3.12, transformers, safetensors, pyarrow,
# tensorboard, tqdm, pytest and pytest-timeout, but not megatron-core or omegaconf: those travel as
# wheels in .whl/ (git-ignored; carry it) and are installed into /tmp/site. Nothing is downloaded there.
# Stages, each under its own time limit (and all under BUDGET_S); a failed stage is recorded and the
# next one still runs:
#   env     GPU, driver, Python packages, whether Transformer Engine / vLLM are importable
#   tests   pytest -m cuda: tests/test_cuda.py (trainer step, fp16 scaler, native engine, TE spec)
#   grpo    30 GRPO steps of a random Qwen2-0.5B-shaped model in bf16: megatron's optimizer with the
#           distributed optimizer, the actor's params, grads and optimizer offloaded around rollout,
#           KL loss with an offloaded reference, the native engine; must finish with finite losses
#   bench   benchmarks/bench_gpu.py: actor MFU (0.5B, 1.5B), native rollout vs generate @64, handoff vs
#           memcpy, and the GRPO run's per-stage peak memory against the planner
#   resume  distributed optimizer: 4 steps straight vs 2 + resume + 2; the weights must agree
# Results under $OUT (or outputs/gpu_check): summary.md (stage, status, seconds), gpu_check.log
# (every stage's output), gpu_section.md (RESULTS.md's `gpu` section; paste it here with
# `python benchmarks/gpu_check.py paste FILE`), tests.md, bench.md, grpo.md, resume.md.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE=full
case "${1:-}" in
  --smoke) MODE=smoke ;;
  --fetch-wheels)
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 omegaconf==2.4.0 ;;
  "") ;;
  *) echo "usage: $0 [--smoke | --fetch-wheels]" >&2; exit 2 ;;
esac

OUTDIR="${OUT:-$ROOT/outputs/gpu_check}"
WORK="$ROOT/outputs/gpu_check_work"   # checkpoints, data, TensorBoard: not sent back
mkdir -p "$OUTDIR" && rm -rf "$WORK" && mkdir -p "$WORK"
LOG="$OUTDIR/gpu_check.log" SUMMARY="$OUTDIR/summary.md"
: > "$LOG"
printf '| stage | status | seconds |\n|---|---|---|\n' > "$SUMMARY"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-460}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"

if [ "$MODE" = full ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "wheel install failed" >> "$LOG"
fi

# stage NAME LIMIT_S COMMAND...: run under min(LIMIT_S, budget left), log it, add a summary row
stage() {
  local name=$1 limit=$2 start=$SECONDS rc status
  shift 2
  local left=$((BUDGET_S - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "| $name | SKIPPED (time budget spent) | 0 |" >> "$SUMMARY"; return 1
  fi
  printf '\n==== %s (limit %ss): %s\n' "$name" "$limit" "$*" >> "$LOG"
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >> "$LOG" 2>&1  # bash: stages may be functions
  rc=$?
  case $rc in 0) status=PASS ;; 124|137) status="FAIL (timed out at ${limit}s)" ;; *) status="FAIL (exit $rc)" ;; esac
  echo "| $name | $status | $((SECONDS - start)) |" >> "$SUMMARY"
  return $rc
}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import importlib.util, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("megatron.core", "omegaconf", "transformers", "transformer_engine", "vllm", "flash_attn"):
    print(f"{name}: {'importable' if importlib.util.find_spec(name.split('.')[0]) else 'absent'}")
import megatron.core, omegaconf, transformers
print("megatron-core", megatron.core.__version__, "omegaconf", omegaconf.__version__, "transformers", transformers.__version__)
EOF
}

# ---- the GRPO run's config (overrides of configs/tiny_cpu.yaml) ------------------------------------
if [ "$MODE" = full ]; then
  STEPS=30
  SHAPE="model.hidden_size=896 model.num_layers=24 model.num_attention_heads=14 model.num_key_value_heads=2
    model.intermediate_size=4864 model.vocab_size=151936 model.max_position_embeddings=32768
    model.rope_theta=1000000.0 model.rms_norm_eps=1e-6 model.params_dtype=bfloat16 actor.optim.lr=1e-6"
  SIZES="data.train_batch_size=8 rollout.n=4 data.max_response_length=48 actor.ppo_mini_batch_size=8
    actor.ppo_micro_batch_size_per_gpu=8 actor.log_prob_micro_batch_size_per_gpu=16 ref.log_prob_micro_batch_size_per_gpu=16"
  PYTEST_ARGS="-m cuda"
  BENCH_ARGS=""
else
  STEPS=2
  SHAPE="model.params_dtype=bfloat16"
  SIZES="data.train_batch_size=4 rollout.n=2 data.max_response_length=8 actor.ppo_mini_batch_size=4"
  PYTEST_ARGS="-m cuda tests/test_cuda.py"  # on CPU every test there skips itself
  BENCH_ARGS="--smoke"
fi
paths() {  # paths of run $1
  echo "data.train_files=[$WORK/data/train.parquet] data.val_files=[$WORK/data/test.parquet]
    trainer.default_local_dir=$WORK/$1/ckpt trainer.log_dir=$WORK/$1/tb trainer.progress_bar=false
    trainer.val_before_train=false trainer.test_freq=0"
}
GRPO="$SHAPE $SIZES parallel.use_distributed_optimizer=true rollout.name=native rollout.free_cache_engine=true
  actor.offload.params=true actor.offload.grads=true actor.offload.optimizer=true
  actor.use_kl_loss=true ref.offload_params=true trainer.total_training_steps=$STEPS"
RESUME="model.params_dtype=bfloat16 parallel.use_distributed_optimizer=true data.train_batch_size=4 rollout.n=2
  actor.ppo_mini_batch_size=4 trainer.total_training_steps=4 trainer.save_freq=2"
train() { "$PY" scripts/train_ppo.py --config configs/tiny_cpu.yaml "$@"; }

resume_check() {
  train $RESUME $(paths straight) trainer.export_hf_dir="$WORK/straight/hf" || return 1
  local mid
  mid=$(find "$WORK/straight/ckpt" -maxdepth 1 -name '*step_2' | head -1)
  [ -n "$mid" ] || { echo "no step-2 checkpoint under $WORK/straight/ckpt"; return 1; }
  train $RESUME $(paths resumed) trainer.resume_mode="$mid" trainer.export_hf_dir="$WORK/resumed/hf" || return 1
  "$PY" benchmarks/gpu_check.py resume-compare --init "$WORK/straight/ckpt/init_hf" --straight "$WORK/straight/hf" \
    --resumed "$WORK/resumed/hf" --out "$OUTDIR/resume.md"
}

tests_check() {  # the outcome of every test, also into tests.md
  "$PY" -m pytest -q -rA -p no:cacheprovider $PYTEST_ARGS > "$WORK/pytest.log" 2>&1
  local rc=$?
  cat "$WORK/pytest.log"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|^=+ .*(passed|failed|skipped|error).* =+$" "$WORK/pytest.log" \
    | sed 's/^/    /' > "$OUTDIR/tests.md"
  return $rc
}

grpo_check() {
  train $GRPO $(paths grpo) || echo "the GRPO run failed; reporting the steps it logged"
  # shellcheck disable=SC2086
  "$PY" benchmarks/gpu_check.py grpo-report --tb "$WORK/grpo/tb" --steps "$STEPS" --out "$OUTDIR/grpo.md" -- $GRPO
}

export PY WORK OUTDIR STEPS GRPO RESUME PYTEST_ARGS
export -f env_report paths train tests_check resume_check grpo_check
stage env 20 env_report
stage tests 75 tests_check
stage grpo 200 grpo_check
# shellcheck disable=SC2086
stage bench 110 "$PY" benchmarks/bench_gpu.py $BENCH_ARGS --fragment "$OUTDIR/bench.md" \
  --memory-from "$WORK/grpo/tb" -- $GRPO
stage resume 75 resume_check
"$PY" benchmarks/gpu_check.py section --dir "$OUTDIR" --out "$OUTDIR/gpu_section.md" >> "$LOG" 2>&1
echo "total: ${SECONDS}s (budget ${BUDGET_S}s, mode $MODE)" >> "$SUMMARY"
cat "$SUMMARY"
! grep -qE "FAIL|SKIPPED" "$SUMMARY"
