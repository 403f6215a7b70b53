#!/usr/bin/env bash
# Device-machine session: GPU tests and/or benchmarks. Logs and tables go to ${OUT:-.}.
#   MOE_OPS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_gpu.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
stage=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then   # wheels the device image lacks (expecttest)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests \
    2>&1 | tee "$out/gpu_tests.log" | tail -25
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  PLOT=""
  python3 -c 'import matplotlib' 2>/dev/null && PLOT="--plot $out/bench.png"
  timeout "${BENCH_TIMEOUT:-240}" python3 -m moe_ops.bench --graph-all \
    --md "$out/bench.md" --csv "$out/bench.csv" $PLOT > "$out/bench.log" 2>&1
  echo "bench_moe rc=$?"
  timeout "${TRAIN_TIMEOUT:-150}" python3 benchmarks/bench_train.py ${TRAIN_ARGS:-} \
    --md "$out/train.md" > "$out/train.log" 2>&1
  echo "bench_train rc=$?"
  timeout "${DECODE_TIMEOUT:-90}" python3 examples/cuda_graph_decode.py > "$out/decode.log" 2>&1
  echo "cuda_graph_decode rc=$?"
  tail -12 "$out/decode.log"; tail -14 "$out/train.log"; tail -40 "$out/bench.log"
fi
