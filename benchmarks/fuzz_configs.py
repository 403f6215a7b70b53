"""Config fuzz on the CPU (not part of the test suite): random small shapes (odd H and I, T from
1 to 40, E from 1 to 64), routings (ids < 0, skew, one expert, empty experts) and float32 /
float16 inputs, each run through Triton's interpreter under the heuristic's config and every
neighbour (moe_ops.tuning.heuristics.neighbours; plus direct rows forced on), the output
compared with the float64 reference. Prints BAD / EXC lines and a count.

    python benchmarks/fuzz_configs.py [seed] [seconds]
"""
import dataclasses
import os
import random
import sys
import time

import torch

import moe_ops  # noqa: F401
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.reference import dispatch_reference
from moe_ops.tuning.heuristics import heuristic_config, neighbours


def main() -> int:
    os.environ["TRITON_INTERPRET"] = "1"   # CPU tensors run the kernels in the interpreter
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    rng = random.Random(seed)
    t_end = time.time() + float(sys.argv[2] if len(sys.argv) > 2 else 300)
    n = bad = 0
    while time.time() < t_end:
        T = rng.choice([1, 2, 3, 4, 5, 8, 17, 40])
        E = rng.choice([1, 2, 3, 5, 8, 16, 64])
        K = rng.randint(1, min(E, 8))
        H = rng.choice([16, 24, 33, 64])
        I = rng.choice([8, 17, 32, 40])
        routing = rng.choice(["uniform", "negative", "skewed", "one_expert", "empty_experts"])
        dtype = rng.choice([torch.float32, torch.float16])
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        try:
            args = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, generator=g, routing=routing)
        except ValueError:   # a routing that this (E, K) cannot make
            continue
        ref = dispatch_reference(*[a.double() if a.is_floating_point() else a for a in args])
        base = heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16)
        cands = dict(neighbours(base, torch.bfloat16))
        # the small-T direct path explicitly too
        cands["direct"] = dataclasses.replace(base, direct=True)
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        for name, cfg in cands.items():
            if cfg.down_ws:
                continue
            if dtype == torch.float32:
                # float32 tiles take twice the shared memory: the sweeps' limits
                cfg = dataclasses.replace(cfg, block_k1=min(cfg.block_k1, 32),
                                          block_k2=min(cfg.block_k2, 32),
                                          num_stages=min(cfg.num_stages, 3))
            try:
                out = dispatch_triton(*args, config=cfg)
            except Exception as e:
                print("EXC", seed, T, H, I, E, K, routing, dtype, name, type(e).__name__,
                      str(e)[:200])
                bad += 1
                continue
            err = ((out.double() - ref).norm() / max(ref.norm(), 1e-30)).item()
            n += 1
            if not err <= tol or out.isnan().any():
                bad += 1
                print("BAD", seed, T, H, I, E, K, routing, dtype, name, err, cfg)
    print("seed", seed, "checked", n, "bad", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
