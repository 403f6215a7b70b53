"""Expert-parallel correctness on GPUs with NCCL: the cases of tests/ep_cases.py (the CPU gloo
tests' cases: both forms, forward and backward, every routing edge case, the sync-free mode,
set-up errors, transformers) on CUDA tensors against the float64 reference of moe.dispatch on the
full weights (single process). One process per GPU:

    torchrun --nproc-per-node 2 benchmarks/ep_gpu_check.py                 # every case but one
    torchrun --nproc-per-node 2 benchmarks/ep_gpu_check.py --cases sf_capacity_overflow_raises
    torchrun --nproc-per-node 2 benchmarks/ep_gpu_check.py --cases repeated_ids_k_above_local_raise

The two error cases end in a device-side assert, after which the CUDA context is unusable: each
runs on its own. Prints one line per case and rank; exits 1 if any case failed. Sets no NCCL or
NVLS environment variable."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.join(_ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import ep_cases  # noqa: E402
import torch  # noqa: E402

# these end in a device-side assert (the CUDA context is lost): run each on its own, last
LAST = ("sf_capacity_overflow_raises", "repeated_ids_k_above_local_raise")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", default=None, help="folder for the per-rank JSON results")
    args = ap.parse_args()
    names = args.cases or [n for n in sorted(ep_cases.CASES) if n not in LAST]
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = args.out or os.path.join(tempfile.gettempdir(), "ep_gpu_check")
    os.makedirs(out, exist_ok=True)
    ep_cases.run_cases(rank, W, "env", names, out, device="cuda",
                       dtype=getattr(torch, args.dtype), timeout_s=120)
    with open(os.path.join(out, f"rank{rank}.json")) as f:
        res = json.load(f)
    failed = 0
    for name in names:
        r = res.get(name, "not run")
        ok = r == "ok"
        failed += not ok
        print(f"rank {rank} {name}: {'ok' if ok else 'FAILED'}" + ("" if ok else "\n" + r),
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
