"""What the warp-specialised kernels are worth (not part of the test suite; run it alone on the GPU:
beside another process they are wrong, benchmarks/NOTES.md entry 28). At T=8192 per shape: the
backward (saved z) with the default configs, with the WS configs of MOE_OPS_WARP_SPECIALIZE=1
compiled without Triton's warp-specialisation pass, and with it; the forward likewise (down GEMM);
ms medians of do_bench, and whether the gradients are bitwise equal to the default's.

    PYTHONPATH=. python benchmarks/ws_ab.py qwen3 olmoe mixtral deepseek
"""
import os
import sys

import torch
import triton

import moe_ops.launch.dispatch as ld
import moe_ops.launch.dispatch_backward as ldb
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.tuning.heuristics import backward_config, dispatch_config, heuristic_config

SH = {"qwen3": (8192, 2048, 768, 128, 8), "mixtral": (8192, 4096, 14336, 8, 2),
      "olmoe": (8192, 2048, 1024, 64, 8), "deepseek": (8192, 7168, 2048, 256, 8)}


def main(argv=None) -> int:
    names = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("ws_ab.py needs a CUDA GPU", file=sys.stderr)
        return 2
    orig = ld.launch_ws
    mode = {"ws": True}

    def patched(*a, **kw):
        return orig(*a, WARP_SPECIALIZE=mode["ws"], **kw)

    ld.launch_ws = ldb.launch_ws = patched   # dispatch_backward imported it by name
    for name in names:
        T, H, I, E, K = SH[name]
        args = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda",
                                    weight_std=0.02)
        go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        os.environ["MOE_OPS_WARP_SPECIALIZE"] = "0"
        cfg0 = dispatch_config(T, E, K, H, I, "cuda", torch.bfloat16)
        bc0 = backward_config(cfg0, "cuda", torch.bfloat16, rows_per_expert=T * K / E,
                              inter_size=I)
        os.environ["MOE_OPS_WARP_SPECIALIZE"] = "1"
        cfg1 = heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16)
        bc1 = backward_config(cfg1, "cuda", torch.bfloat16, rows_per_expert=T * K / E,
                              inter_size=I)
        _, z = dispatch_triton(*args, config=cfg0, save_z=True)
        res = {}
        ref = None
        for label, bc, ws in (("default", bc0, True), ("ws-kernels no-WS-pass", bc1, False),
                              ("ws-kernels WS", bc1, True)):
            mode["ws"] = ws
            f = lambda: ldb.dispatch_backward_triton(go, *args, z=z, config=cfg0, bwd_config=bc)  # noqa: E731,B023
            got = f()
            if ref is None:
                ref = got
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            res[label] = (triton.testing.do_bench(f, warmup=50, rep=300), same)
        fwd = {}
        for label, c, ws in (("fwd default", cfg0, True), ("fwd down_ws no-pass", cfg1, False),
                             ("fwd down_ws WS", cfg1, True)):
            mode["ws"] = ws
            fwd[label] = triton.testing.do_bench(lambda: dispatch_triton(*args, config=c),  # noqa: B023
                                                 warmup=50, rep=300)
        print(name, bc1.wg_ws, bc1.rows_ws, cfg1.down_ws,
              {k: (round(v[0], 3), v[1]) for k, v in res.items()},
              {k: round(v, 3) for k, v in fwd.items()}, flush=True)
    ld.launch_ws = ldb.launch_ws = orig
    return 0


if __name__ == "__main__":
    sys.exit(main())
