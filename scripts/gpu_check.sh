#!/usr/bin/env bash
# One command for a lent GPU, about 6 minutes on one H200 and never more than 8 (a time
# budget: each step gets its own cap or what is left, whichever is less):
#   env, checkpoint   versions and the device; Qwen3-0.6B-shaped random bf16 weights,
#                     built on the machine (no download) and cached for every later step
#   gpu tests         pytest -m gpu
#   attention         decode paged attention: GB/s against the measured copy bandwidth at
#                     a few (batch, context) points, single pass vs every split count
#   latency           decode step with CUDA graphs on and off at batch 1/32/256: the
#                     forward against the wall time of a whole engine step
#   agreement         bf16 greedy tokens against transformers on the 0.6B shape
#   nano workload     nanokv twice (cold, then warm), then HF generate at batch 256 (its
#                     best: one padded batch) on nano-vllm's workload
#   host micro        bench.py --micro: host time per decode step and the sampler
# Each step prints and flushes its result when it completes, and merges it into
# $OUT/gpu_check.json (default /tmp/gpu_check); everything printed also goes to
# $OUT/gpu_check.log, the gpu tests' log to $OUT/gpu_tests.txt.
#
#   scripts/gpu_check.sh              on the GPU machine (python3, or $PYTHON)
#   scripts/gpu_check.sh --dry-run    the same steps at toy sizes on the CPU (plumbing only)
#
# Runs from the checkout (PYTHONPATH=.) on an image that has torch, transformers, triton,
# xxhash, tqdm, safetensors and pytest; or pip install --target .gpu_deps what is missing
# and carry .gpu_deps along.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=""
if [ "${1:-}" = "--dry-run" ]; then
  DRY="--dry-run"
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
fi
export PYTHONPATH=".:.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
rm -f "$OUT/gpu_check.json"
exec > >(tee "$OUT/gpu_check.log") 2>&1
BUDGET=${GPU_CHECK_BUDGET:-465}  # seconds, all steps together
START=$(date +%s)

# step NAME CAP CMD...: run CMD with at most CAP seconds (less if the budget has less);
# a step that times out or fails is marked so in the record, and the next one runs.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped, the time budget is spent"
    $PY scripts/gpu_check.py mark "$name" skipped
    return 0
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name (at most ${cap}s, $(( $(date +%s) - START ))s so far) =="
  # in a child bash, so that the shell functions below run under timeout too
  STEP_CAP=$cap timeout -k 5 "$cap" bash -c '"$@"' _ "$@"
  local rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "== $name: timed out after ${cap}s"
    $PY scripts/gpu_check.py mark "$name" timeout
  elif [ "$rc" -ne 0 ]; then
    echo "== $name: failed (exit $rc)"
    $PY scripts/gpu_check.py mark "$name" failed
  fi
  return 0
}

# pytest (stopped 10 s before the step's cap), then its counts into the record
gpu_tests() {
  local rc=0 only=""
  [ -n "$DRY" ] && only="--collect-only"  # no GPU: that they collect
  timeout -k 5 $(( STEP_CAP - 10 )) $PY -m pytest -q -m gpu -p no:cacheprovider $only tests \
    >"$OUT/gpu_tests.txt" 2>&1 || rc=$?
  tail -15 "$OUT/gpu_tests.txt"
  $PY scripts/gpu_check.py record-tests "$OUT/gpu_tests.txt" "$rc"
}

# bench.py --json (stopped 10 s before the step's cap) into a scratch file, then its
# numbers into the record
bench() {
  local name=$1 rc=0
  shift
  timeout -k 5 $(( STEP_CAP - 10 )) $PY bench.py "$@" --json >"$OUT/.bench_$name.json" \
    2>"$OUT/.bench_$name.err" || rc=$?
  [ "$rc" -eq 0 ] || tail -20 "$OUT/.bench_$name.err"
  $PY scripts/gpu_check.py record-bench "$name" "$OUT/.bench_$name.json" "$rc"
  rm -f "$OUT/.bench_$name.json" "$OUT/.bench_$name.err"
}
export -f gpu_tests bench
export PY DRY

if [ -n "$DRY" ]; then
  SHAPE=qwen3-tiny; WORKLOAD="--workload tiny --hf-batch-sizes 4"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  SHAPE=qwen3-0.6b; WORKLOAD="--workload nano --hf-batch-sizes 256"
fi
step env 60 $PY scripts/gpu_check.py env $DRY
step checkpoint 90 $PY scripts/gpu_check.py checkpoint $DRY
step gpu_tests 150 gpu_tests
step attention 75 $PY scripts/gpu_check.py attention $DRY
step latency 100 $PY scripts/gpu_check.py latency $DRY
step agreement 60 $PY scripts/gpu_check.py agreement $DRY
step nano_nanokv 110 bench nano_nanokv $WORKLOAD --shape $SHAPE --engines nanokv --repeats 2
step nano_hf 120 bench nano_hf $WORKLOAD --shape $SHAPE --engines hf --repeats 1
if [ -z "$DRY" ]; then  # measured on the CPU too; last, as the budget allows
  step micro 60 bench micro --micro
fi
echo "== done in $(( $(date +%s) - START ))s =="
$PY scripts/gpu_check.py summary
