#!/usr/bin/env bash
# On a GPU machine: the GPU tests and/or benchmarks. Logs and tables go to ${OUT:-.}.
#   MOE_OPS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_gpu.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
stage=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then   # wheels the device image lacks (expecttest)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
elif [ "$stage" != bench ]; then   # .whl is git-ignored: the device tool's carry=[".whl"] brings it
  echo "WARNING: no .whl/*.whl here (pass carry=[\".whl\"]): tests/test_tuning.py will fail to import expecttest" >&2
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  # Three pytest processes share the GPU: most of the time is Triton compiling on the CPU. Peak
  # memory of the three together stays under ~100 GiB (DeepSeek-V3 float32 parity is the largest).
  run_group() {  # name, pytest args...
    local name=$1; shift
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$@" \
      > "$out/gpu_tests_$name.log" 2>&1
    echo "[$name] rc=$? $(tail -1 "$out/gpu_tests_$name.log")"
  }
  run_group forward tests/test_dispatch_gpu.py tests/test_route_gpu.py &
  run_group backward tests/test_dispatch_backward_gpu.py &
  run_group rest tests --ignore=tests/test_dispatch_gpu.py --ignore=tests/test_route_gpu.py \
    --ignore=tests/test_dispatch_backward_gpu.py &
  wait
  grep -h "^FAILED\|^ERROR" "$out"/gpu_tests_*.log | head -20
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  PLOT=""
  python3 -c 'import matplotlib' 2>/dev/null && PLOT="--plot $out/bench.png"
  timeout "${BENCH_TIMEOUT:-240}" python3 -m moe_ops.tools.bench --graph-all \
    --md "$out/bench.md" --csv "$out/bench.csv" $PLOT > "$out/bench.log" 2>&1
  echo "bench_moe rc=$?"
  timeout "${TRAIN_TIMEOUT:-150}" python3 benchmarks/bench_train.py ${TRAIN_ARGS:-} \
    --md "$out/train.md" > "$out/train.log" 2>&1
  echo "bench_train rc=$?"
  if [ "${DECODE_TIMEOUT:-90}" != 0 ]; then
    timeout "${DECODE_TIMEOUT:-90}" python3 examples/cuda_graph_decode.py > "$out/decode.log" 2>&1
    echo "cuda_graph_decode rc=$?"; tail -12 "$out/decode.log"
  fi
  if [ "${EXAMPLE_TIMEOUT:-0}" != 0 ]; then   # the training example (off by default)
    timeout "$EXAMPLE_TIMEOUT" python3 examples/train_moe.py --device cuda > "$out/train_moe.log" 2>&1
    echo "train_moe rc=$?"; tail -8 "$out/train_moe.log"
  fi
  tail -14 "$out/train.log"; tail -40 "$out/bench.log"
fi
