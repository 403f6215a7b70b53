#!/usr/bin/env bash
# A/B of one autograd training step of moe.dispatch (benchmarks/profile_train_step.py) between
# this tree and another copy of the package, alternating processes (the device host's eager
# figures drift between calls: only interleaved comparisons mean anything).
#   bash benchmarks/ab_train_step.sh OTHER_DIR ROUNDS CELL...
# OTHER_DIR holds a moe_ops/ package (e.g. `git archive <sha> moe_ops | tar -x -C OTHER_DIR`).
set -uo pipefail
cd "$(dirname "$0")/.."
other=$1; rounds=$2; shift 2
for r in $(seq "$rounds"); do
  for tree in this other; do
    p=.; [ "$tree" = other ] && p=$other
    PYTHONPATH="$p:${PYTHONPATH:-}" timeout 200 python3 benchmarks/profile_train_step.py \
      --cells "$@" --top 0 2>/dev/null | sed -n '/^cell /,$p' | tail -n +2 | sed "s/^/$tree r$r  /"
  done
done
