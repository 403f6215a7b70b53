#!/usr/bin/env bash
# Device-machine session: GPU tests and/or benchmarks. Logs and tables go to ${OUT:-.}.
#   MOE_OPS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_gpu.sh [tests|bench|all|stress|wsexp]
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
  run_group forward tests/test_gpu.py -k "not backward and not warp_specialised_kernels_repeat" &
  run_group backward tests/test_gpu.py -k backward &
  run_group rest tests --ignore=tests/test_gpu.py &
  wait
  # the opt-in warp-specialised kernels fail beside another GPU process (NOTES.md entry 28):
  # their test runs by itself
  run_group ws_alone tests/test_gpu.py -k warp_specialised_kernels_repeat
  grep -h "^FAILED\|^ERROR" "$out"/gpu_tests_*.log | head -20
fi
if [ "$stage" = stress ]; then
  # The warp-specialised kernels under a shared GPU (NOTES.md entry 27): WS on, WS off, and WS on
  # with a descriptor scratch that is never reused; each ${STRESS_SECONDS:-60} s.
  for v in "--ws on" "--ws off" "--ws on --scratch fresh"; do
    timeout $(( ${STRESS_SECONDS:-60} + 120 )) python3 benchmarks/ws_stress.py --case "${STRESS_CASE:-large_offsets}" \
      --procs 3 --noise 1 --seconds "${STRESS_SECONDS:-60}" $v 2>&1 | tee -a "$out/ws_stress.log" | tail -5
  done
fi
if [ "$stage" = wsexp ]; then
  # NOTES.md entry 28's next experiments, ${WSEXP_SECONDS:-15} s each: the minimal WS GEMM
  # (ws_repro.py) alone / beside a matmul process / without the WS pass / with host-made
  # descriptors / at maxnreg 128; then moe_ops' own WS kernels at maxnreg 128 (128-wide tiles)
  # and with 64-row tiles (one consumer warp group), each beside a matmul process.
  s=${WSEXP_SECONDS:-15}
  for v in "--ws on --noise 0" "--ws on --noise 1" "--ws off --noise 1" "--ws on --noise 1 --desc host" \
           "--ws on --noise 1 --maxnreg 128"; do
    timeout $(( s + 120 )) python3 benchmarks/ws_repro.py --seconds "$s" $v 2>&1 | tee -a "$out/ws_repro.log" | tail -1
  done
  WS_STRESS_MAXNREG=128 WS_STRESS_BWD="wg_n=128,dx_n=128" timeout $(( s + 150 )) python3 benchmarks/ws_stress.py \
    --case large_offsets --procs 1 --noise 1 --seconds "$s" --fwd-ws off 2>&1 | tee -a "$out/ws_stress.log" | tail -3
  WS_STRESS_FWD="block_m=64" WS_STRESS_BWD="wg_m=64" timeout $(( s + 150 )) python3 benchmarks/ws_stress.py \
    --case large_offsets --procs 1 --noise 1 --seconds "$s" 2>&1 | tee -a "$out/ws_stress.log" | tail -3
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
  if [ "${DECODE_TIMEOUT:-90}" != 0 ]; then
    timeout "${DECODE_TIMEOUT:-90}" python3 examples/cuda_graph_decode.py > "$out/decode.log" 2>&1
    echo "cuda_graph_decode rc=$?"; tail -12 "$out/decode.log"
  fi
  if [ "${EXAMPLE_TIMEOUT:-0}" != 0 ]; then   # issue 6's training example (off by default)
    timeout "$EXAMPLE_TIMEOUT" python3 examples/train_moe.py --device cuda > "$out/train_moe.log" 2>&1
    echo "train_moe rc=$?"; tail -8 "$out/train_moe.log"
  fi
  tail -14 "$out/train.log"; tail -40 "$out/bench.log"
fi
