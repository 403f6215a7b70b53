#!/usr/bin/env bash
# One device-machine session: GPU tests, then the forward benchmark (every shape and T, eager and
# CUDA-graph replay at every T). Logs and tables go to ${OUT:-.} (the device tool's $OUT).
#   MOE_OPS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_gpu.sh [pytest selection...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
if ls .whl/*.whl >/dev/null 2>&1; then   # wheels the device image lacks (expecttest)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider "${@:-tests}" 2>&1 \
  | tee "$out/gpu_tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_moe.py --graph-all \
  --md "$out/bench.md" --csv "$out/bench.csv" 2>&1 | tee "$out/bench.log" | tail -45
