#!/usr/bin/env bash
# One command for a lent GPU: the gpu-marked tests, then nanokv vs HF generate on a
# Qwen3-0.6B-shaped model with random weights built on the device (no download).
# Runs from the checkout (PYTHONPATH=.) on an image that already has torch,
# transformers, triton, xxhash, tqdm and safetensors. pytest is taken from the image, or
# from .gpu_deps/ (pip install --target .gpu_deps pytest hypothesis, carried along).
# Budget: well under 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".:.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

echo "== gpu tests =="
if python -c "import pytest" 2>/dev/null; then
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
  tests_rc=${PIPESTATUS[0]}
else
  echo "pytest is not importable: skipping the gpu tests (carry .gpu_deps with pytest)"
  tests_rc=2
fi

echo "== throughput: nano workload (256 requests, 100-1024 in / 100-1024 out), random Qwen3-0.6B, bf16 =="
timeout 300 python bench.py --workload nano --shape qwen3-0.6b --engines nanokv,hf \
  --hf-batch-sizes 64,128 2>"$OUT/bench_stderr.txt" | tee "$OUT/bench.md"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || tail -20 "$OUT/bench_stderr.txt"

echo "gpu tests exit $tests_rc, bench exit $bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
