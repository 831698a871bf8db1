#!/usr/bin/env bash
# hybridrl's first GPU run: one unattended pass over the CUDA paths, within BUDGET_S (335 s) on one H200.
#
#   benchmarks/gpu_check.sh --fetch-wheels  here, with network: the wheels the GPU image lacks, into .whl/
#   benchmarks/gpu_check.sh                 on the GPU machine, in the repository root's copy; through the
#                                           device tool: run(command="benchmarks/gpu_check.sh",
#                                           carry=[".whl"], timeout_s=400)
#   benchmarks/gpu_check.sh --smoke         every stage at tiny sizes on CPU (checks this script)
#
# The device: 15 minutes per session in all (machine starts and idle time included), one command at most
# 600 s. BUDGET_S fits two runs (the first, and one after fixing what it found) and two machine starts
# (2 x 335 s + 2 x ~90 s start + idle), and a run ends on its own well before timeout_s.
# The GPU image has torch 2.11 + CUDA 13 on Python 3.12, safetensors, pyarrow, tensorboard, tqdm, pytest
# and pytest-timeout and an older transformers, but not megatron-core or omegaconf. Those and
# requirements.txt's transformers travel as wheels: `--fetch-wheels` downloads them into .whl/ at the
# repository root (git-ignored; the device's `run` names it in `carry`), checks each is there once and
# intact, and prints their exact paths and sizes (about 15 MiB; the tree and the wheels must stay under
# the 64 MiB that travels). The run installs them into /tmp/site (nothing is downloaded there); a failed
# install ends the run (exit 3) before any stage, since nothing else would import.
# Stages, each under its own time limit; the limits add up to at most BUDGET_S (checked at the start).
# A failed stage is recorded and the next one still runs:
#   wheels  the wheels present, intact, installed (smoke: installed for cp312 into a scratch folder)
#   env     GPU, driver, Python packages, whether Transformer Engine / vLLM / flash attention are there
#   tests   pytest -m cuda: tests/test_cuda.py (trainer step, fp16 scaler, native engine, SDPA attention
#           against megatron's unfused one, TE spec)
#   grpo    10 GRPO steps of a random Qwen2-0.5B-shaped model in bf16: megatron's optimizer with the
#           distributed optimizer, the actor's params, grads and optimizer offloaded around rollout,
#           KL loss with an offloaded reference, the native engine; must finish with finite losses
#   bench   benchmarks/bench_gpu.py: actor MFU (0.5B, 1.5B; with the layer spec and core attention that
#           ran), native rollout vs generate @64, handoff vs memcpy (direct shard path and bucketed path),
#           and the GRPO run's per-stage peak memory against the planner
#   resume  distributed optimizer: 4 steps straight vs 2 + resume + 2; the weights must agree
#   vllm    only where vLLM imports (requirements-gpu.txt's range; the image lacks it, and it is too big to
#           travel as a wheel): benchmarks/gpu_vllm_check.py for a dense (qwen2) and an MoE (qwen3_moe) tiny
#           model at TP 2 (TP 1 on one GPU): verified handoff, vLLM's parameter names and shapes against
#           tests/data/vllm_0_33_names.json, greedy tokens and processed log-probs of vLLM vs the actor.
#           Its limit (VLLM_LIMIT_S, 150 s) is added to BUDGET_S only then: such a run fits once per session.
# Results under $OUT (or outputs/gpu_check): summary.md (stage, status, seconds), gpu_check.log
# (every stage's output), gpu_section.md (RESULTS.md's `gpu` section; paste it here with
# `python benchmarks/gpu_check.py paste FILE`), tests.md, bench.md, grpo.md, resume.md, vllm_<family>.md.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
WHEELS="megatron-core==0.16.1 omegaconf==2.4.0 transformers==5.24.0"  # the pins of requirements.txt
TRAVEL_LIMIT_BYTES=$((64 * 1024 * 1024))  # the device's limit on the tree and the carried wheels together

wheel_files() {  # the .whl/ file of each pinned wheel, one per line; fails naming one that is missing or twice
  local spec name version files
  for spec in $WHEELS; do
    name=${spec%%==*} version=${spec##*==}
    files=$(ls "$WHEEL_DIR/${name//-/_}-$version-"*.whl 2>/dev/null)
    if [ "$(printf '%s' "$files" | grep -c .)" != 1 ]; then
      echo "error: want exactly one wheel of $spec in $WHEEL_DIR, found: ${files:-none};" \
        "run benchmarks/gpu_check.sh --fetch-wheels here and carry .whl" >&2
      return 1
    fi
    echo "$files"
  done
}

check_wheels() {  # each pinned wheel once and intact; their paths and sizes; within the travel limit
  local files total=0 tree=0 size f
  files=$(wheel_files) || return 1
  for f in $files; do
    "${PY:-python3}" -m zipfile -t "$f" > /dev/null || { echo "error: $f is not an intact wheel" >&2; return 1; }
    size=$(stat -c %s "$f")
    total=$((total + size))
    echo "  $f  $size bytes"
  done
  if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then  # what travels besides: tracked + untracked files
    tree=$(git -C "$ROOT" ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  fi
  echo "  wheels $total bytes + working tree ${tree} bytes = $((total + tree)) of $TRAVEL_LIMIT_BYTES"
  [ $((total + tree)) -le $TRAVEL_LIMIT_BYTES ] || { echo "error: over the device's travel limit" >&2; return 1; }
}

install_wheels() {  # into $SITE; smoke (another Python here): installed for cp312 only, not imported
  local files platform=()
  files=$(wheel_files) || return 1
  check_wheels || return 1
  rm -rf "$SITE" && mkdir -p "$SITE"
  if [ "$MODE" = smoke ]; then
    platform=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64)
  fi
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${platform[@]}" $files || { echo "error: pip could not install the wheels from $WHEEL_DIR" >&2; return 1; }
  local spec name
  for spec in $WHEELS; do  # what pip put there is what was pinned
    name=${spec%%==*}
    ls -d "$SITE/${name//-/_}-${spec##*==}.dist-info" > /dev/null || { echo "error: $spec missing in $SITE" >&2; return 1; }
  done
  [ "$MODE" = smoke ] && return 0
  PYTHONPATH="$SITE:$PYTHONPATH" "$PY" -c "
import megatron.core, omegaconf, transformers
got = (megatron.core.__version__, omegaconf.__version__, transformers.__version__)
assert got == ('0.16.1', '2.4.0', '5.24.0'), got
print('imported from $SITE:', got)"
}

MODE=full
case "${1:-}" in
  --smoke) MODE=smoke ;;
  --fetch-wheels)
    rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR"
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEEL_DIR" $WHEELS || { echo "error: pip download failed" >&2; exit 1; }
    echo "wheels for the device run (carry .whl):"
    check_wheels
    exit ;;
  "") ;;
  *) echo "usage: $0 [--smoke | --fetch-wheels]" >&2; exit 2 ;;
esac

OUTDIR="${OUT:-$ROOT/outputs/gpu_check}"
WORK="$ROOT/outputs/gpu_check_work"   # checkpoints, data, TensorBoard: not sent back
SITE=/tmp/site                        # where the wheels go (smoke: a scratch folder, never imported)
[ "$MODE" = smoke ] && SITE="$WORK/site"
mkdir -p "$OUTDIR" && rm -rf "$WORK" && mkdir -p "$WORK"
LOG="$OUTDIR/gpu_check.log" SUMMARY="$OUTDIR/summary.md"
: > "$LOG"
printf '| stage | status | seconds (limit) |\n|---|---|---|\n' > "$SUMMARY"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"

# Time limits (s) per stage on the GPU; on CPU (smoke) each is SMOKE_SCALE times longer. Their sum and a
# few seconds for the report must fit BUDGET_S.
declare -A LIMIT=([wheels]=30 [env]=10 [tests]=65 [grpo]=90 [bench]=90 [resume]=45)
HAVE_VLLM=$("$PY" -c "import importlib.util as u; print(int(u.find_spec('vllm') is not None))" 2>/dev/null || echo 0)
VLLM_BUDGET=0
if [ "$HAVE_VLLM" = 1 ]; then LIMIT[vllm]=${VLLM_LIMIT_S:-150} VLLM_BUDGET=${VLLM_LIMIT_S:-150}; fi
SCALE=1
[ "$MODE" = smoke ] && SCALE="${SMOKE_SCALE:-4}"
BUDGET_S=$(( (${BUDGET_S:-335} + VLLM_BUDGET) * SCALE ))
planned=0
for name in "${!LIMIT[@]}"; do LIMIT[$name]=$((LIMIT[$name] * SCALE)); planned=$((planned + LIMIT[$name])); done
if [ $((planned + 5 * SCALE)) -gt "$BUDGET_S" ]; then
  echo "error: the stage limits add up to ${planned}s, over BUDGET_S=${BUDGET_S}s less 5 s for the report" >&2
  exit 2
fi

# stage NAME COMMAND...: run under min(its limit, budget left), log it, add a summary row
stage() {
  local name=$1 limit=${LIMIT[$1]} start=$SECONDS rc status
  shift
  local left=$((BUDGET_S - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "| $name | SKIPPED (time budget spent) | 0 |" >> "$SUMMARY"; return 1
  fi
  printf '\n==== %s (limit %ss): %s\n' "$name" "$limit" "$*" >> "$LOG"
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >> "$LOG" 2>&1  # bash: stages may be functions
  rc=$?
  case $rc in 0) status=PASS ;; 124|137) status="FAIL (timed out at ${limit}s)" ;; *) status="FAIL (exit $rc)" ;; esac
  echo "| $name | $status | $((SECONDS - start)) (${LIMIT[$name]}) |" >> "$SUMMARY"
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
print("megatron-core", megatron.core.__version__, "omegaconf", omegaconf.__version__, "transformers", transformers.__version__,
      "from", transformers.__file__)
if torch.cuda.is_available():  # which fused kernels SDPAttention (the local spec's attention) may take
    b = torch.backends.cuda
    print("sdpa kernels enabled: flash", b.flash_sdp_enabled(), "mem-efficient", b.mem_efficient_sdp_enabled(),
          "cudnn", b.cudnn_sdp_enabled(), "math", b.math_sdp_enabled())
EOF
}

# ---- the GRPO run's config (overrides of configs/tiny_cpu.yaml) ------------------------------------
if [ "$MODE" = full ]; then
  STEPS=10
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

vllm_check() {  # vLLM against the actor: a dense and an MoE model, at TP 2 where two GPUs are there
  local tp=2 family rc=0
  [ "$("$PY" -c "import torch; print(torch.cuda.device_count())")" -ge 2 ] || { tp=1; echo "one GPU: TP 1, not 2"; }
  for family in qwen2 qwen3_moe; do
    "$PY" -m torch.distributed.run --standalone --nproc_per_node="$tp" benchmarks/gpu_vllm_check.py \
      --family "$family" --work "$WORK" --out "$OUTDIR/vllm_$family.md" || rc=1
  done
  return $rc
}

export PY WORK OUTDIR STEPS GRPO RESUME PYTEST_ARGS MODE SITE WHEELS WHEEL_DIR TRAVEL_LIMIT_BYTES ROOT
export -f env_report paths train tests_check resume_check grpo_check wheel_files check_wheels install_wheels vllm_check
if ! stage wheels install_wheels; then
  grep -E "^error:" "$LOG" | tail -3 >&2
  if [ "$MODE" = full ]; then  # nothing below would import megatron-core
    echo "total: ${SECONDS}s: the wheels did not install; no stage ran (see $LOG)" >> "$SUMMARY"
    cat "$SUMMARY"
    exit 3
  fi
fi
[ "$MODE" = full ] && export PYTHONPATH="$SITE:$PYTHONPATH"
stage env env_report
stage tests tests_check
stage grpo grpo_check
# shellcheck disable=SC2086
stage bench "$PY" benchmarks/bench_gpu.py $BENCH_ARGS --fragment "$OUTDIR/bench.md" \
  --memory-from "$WORK/grpo/tb" -- $GRPO
stage resume resume_check
if [ "$HAVE_VLLM" = 1 ]; then
  stage vllm vllm_check
else
  echo "| vllm | not run (vLLM does not import here) | 0 |" >> "$SUMMARY"
fi
"$PY" benchmarks/gpu_check.py section --dir "$OUTDIR" --out "$OUTDIR/gpu_section.md" >> "$LOG" 2>&1
echo "total: ${SECONDS}s (budget ${BUDGET_S}s, stage limits ${planned}s, mode $MODE)" >> "$SUMMARY"
cat "$SUMMARY"
! grep -qE "FAIL|SKIPPED" "$SUMMARY"
