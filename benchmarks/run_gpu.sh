#!/usr/bin/env bash
# GPU machine: the GPU test suite and/or the benchmarks, from a checkout (no install needed).
# Logs and tables go to ${OUT:-.}.
#   MOE_OPS_COMMIT=<commit> bash benchmarks/run_gpu.sh [tests|bench|all]
# (write the commit into the command, from `git rev-parse --short HEAD` here: a copied tree's
# .git can be older than its files, and the benchmarks record MOE_OPS_COMMIT first)
# Environment: TEST_TIMEOUT (s per test group, 420), BENCH_TIMEOUT (240), TRAIN_TIMEOUT (150),
# TRAIN_ARGS (extra bench_train.py flags, e.g. "--tokens 8192"), DECODE_TIMEOUT (90; 0 skips
# examples/cuda_graph_decode.py), EXAMPLE_TIMEOUT (0 skips examples/train_moe.py --device cuda),
# TRITON_ENV (a script sourced first that puts another Triton on the path, e.g. the env.sh of
# ../shared/tools/device-triton.sh; the tests marked "inductor" are then left out), PYTEST_ARGS
# (added to every test group, e.g. "-k 'not compile'"), WEIGHTS (quant stage: the --weights runs, default "fp8 mxfp4"),
# PYTEST_WORKERS (pytest-xdist processes per test group, e.g. 4: compilation, most of a group's
# time, then runs in parallel; needs pytest-xdist, which can travel as a wheel in .whl/).
# Stages: tests, bench, quant (moe-ops-bench --weights for each of WEIGHTS), all (tests, bench).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
stage=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then   # wheels a bare GPU image may lack (expecttest)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
elif [ "$stage" != bench ]; then
  echo "WARNING: no .whl/*.whl here: tests that use expecttest fail to import without it" >&2
fi
mexpr=gpu
if [ -n "${TRITON_ENV:-}" ]; then
  # shellcheck disable=SC1090
  . "$TRITON_ENV" || exit
  # TorchInductor's generated kernels need the Triton torch was built with: its tests
  # (marker "inductor") run with the image's Triton only
  mexpr="gpu and not inductor"
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
eval "extra=(${PYTEST_ARGS:-})"   # shell words: quotes group
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  # Three pytest processes share the GPU: most of the time is Triton compiling on the CPU. Peak
  # memory of the three together stays under ~100 GiB (DeepSeek-V3 float32 parity is the largest).
  # The three groups partition the GPU tests: the forward GPU files, the backward one, the rest.
  run_group() {  # name, pytest args...
    local name=$1; shift
    local workers=() n=${PYTEST_WORKERS:-}
    # below 100 GiB the forward and backward groups' float64 references (up to ~60 GiB for
    # DeepSeek-V3) leave room for two workers, not four (H100, 4 workers: 30 tests out of memory)
    if [ -n "$n" ] && [ "$small" = 1 ] && [ "$name" != rest ] && [ "$n" -gt 2 ]; then n=2; fi
    # loadgroup: the DeepSeek-V3 tests (tests/conftest.py marks them) share one worker
    [ -n "$n" ] && workers=(-n "$n" --dist loadgroup)
    # -v: one line per test as it finishes, so that a group cut off by its timeout still names
    # its failures (pytest's summary, -rf, prints only at the end)
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -v -rf -m "$mexpr" -p no:cacheprovider --durations=5 "${workers[@]}" "$@" "${extra[@]}" \
      > "$out/gpu_tests_$name.log" 2>&1
    local rc=$? log="$out/gpu_tests_$name.log"
    echo "[$name] rc=$rc $(tail -1 "$log") ($(grep -c ' PASSED' "$log") passed,"\
         "$(grep -c ' FAILED' "$log") failed, $(grep -c ' SKIPPED' "$log") skipped so far)"
  }
  # Below 100 GiB of GPU memory (the H100's 80 GB) the backward group, whose DeepSeek-V3
  # float64 references take ~60 GiB, runs alone after the other two: all three at once ran out
  # of memory there (9 tests, H100, Triton 3.7.1).
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  small=0; [ "${mem_mib:-0}" -lt 100000 ] && small=1
  rest=(tests --ignore=tests/test_dispatch_gpu.py --ignore=tests/test_route_gpu.py
        --ignore=tests/test_dispatch_backward_gpu.py)
  if [ "$small" = 1 ] && [ -n "${PYTEST_WORKERS:-}" ]; then
    # with several workers per group, one group at a time (two side by side ran out of memory)
    run_group forward tests/test_dispatch_gpu.py tests/test_route_gpu.py
    run_group rest "${rest[@]}"
    run_group backward tests/test_dispatch_backward_gpu.py
  else
    run_group forward tests/test_dispatch_gpu.py tests/test_route_gpu.py &
    [ "$small" = 0 ] && run_group backward tests/test_dispatch_backward_gpu.py &
    run_group rest "${rest[@]}" &
    wait
    [ "$small" = 1 ] && run_group backward tests/test_dispatch_backward_gpu.py
  fi
  grep -h " FAILED\| ERROR\|^FAILED\|^ERROR" "$out"/gpu_tests_*.log | grep -o "tests/[^ ]*" | sort -u | head -30
fi
if [ "$stage" = quant ]; then
  for w in ${WEIGHTS:-fp8 mxfp4}; do
    timeout "${BENCH_TIMEOUT:-240}" python3 -m moe_ops.tools.bench --weights "$w" --graph-all \
      --md "$out/bench_$w.md" --csv "$out/bench_$w.csv" > "$out/bench_$w.log" 2>&1
    echo "moe-ops-bench --weights $w rc=$?"; grep -A16 "^| shape | T | floor" "$out/bench_$w.md"
  done
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  PLOT=""
  python3 -c 'import matplotlib' 2>/dev/null && PLOT="--plot $out/bench.png"
  timeout "${BENCH_TIMEOUT:-240}" python3 -m moe_ops.tools.bench --graph-all \
    --md "$out/bench.md" --csv "$out/bench.csv" $PLOT > "$out/bench.log" 2>&1
  echo "moe-ops-bench rc=$?"
  timeout "${TRAIN_TIMEOUT:-150}" python3 benchmarks/bench_train.py ${TRAIN_ARGS:-} \
    --md "$out/train.md" --csv "$out/train.csv" > "$out/train.log" 2>&1
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
