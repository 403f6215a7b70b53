"""What the hardware and the vendor GEMM reach on moe_ops' own problem shapes (not a test).

For each cell (shape, T) with uniform routing (every expert gets exactly T*K/E rows), this times
  - each GEMM of a training step as one torch._grouped_mm call (cuBLAS / CUTLASS grouped GEMM,
    the best vendor code PyTorch ships): forward gate+up [rows, H] x [H, 2I], down [rows, I] x
    [I, H], backward dA = dO W2_e [rows, H] x [H, I], dx = dz W13_e [rows, 2I] x [2I, H], and the
    weight gradients dW13_e = dz^T x, dW2_e = dO^T (s a) (contraction over the expert's rows);
  - moe_ops' kernels for the same work (torch.profiler sums per kernel name over a forward with z
    saved and a backward: the forward's down GEMM and the backward's dA and dx share a kernel);
and, once, the L2 read bandwidth (a Triton kernel in which every program re-reads its slice of
an L2-resident buffer) and the device copy bandwidth. Purpose: tell a kernel that is far from
the roofline because of its code from one that is far because of its shape (short reductions,
little reuse per L2 byte), by asking what the vendor GEMM does on that same shape.

    PYTHONPATH=. python benchmarks/probe_ceilings.py [--cells qwen3_30b_a3b:8192 ...]
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from moe_ops.tools import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.dispatch_backward import dispatch_backward_triton
from moe_ops.tuning.shapes import SHAPES


@triton.jit
def _l2_read_kernel(src, out, slice_elems, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for it in range(iters):
        # another program's slice each pass (nothing this SM read before), loads that skip L1
        base = src + ((pid + it * 7) % n_prog).to(tl.int64) * slice_elems
        for off in range(0, slice_elems, BLOCK):
            acc += tl.load(base + off + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)


def l2_read_bandwidth(dev, mb=16, programs_per_sm=4, iters=40) -> float:
    """bytes/s of reads served by L2: each program reads `iters` slices of a buffer of mb MiB
    (resident in the 50 MB L2), a different program's slice each time, bypassing L1 (.cg)."""
    n_prog = torch.cuda.get_device_properties(dev).multi_processor_count * programs_per_sm
    block = 2048
    slice_elems = (mb << 20) // 4 // n_prog // block * block
    src = torch.randn(n_prog * slice_elems, device=dev)
    out = torch.empty(n_prog * block, device=dev)

    def run():
        _l2_read_kernel[(n_prog,)](src, out, slice_elems, iters, BLOCK=block, num_warps=8)

    run()
    ms = min(triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
             for _ in range(3))
    return n_prog * slice_elems * 4 * iters / (ms * 1e-3)


def best_ms(fn, rounds=3) -> float:
    fn()
    torch.cuda.synchronize()
    return min(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
               for _ in range(rounds))


def vendor_gemms(H, I, E, K, T, dev) -> dict:
    """ms of one torch._grouped_mm call per GEMM of the step, uniform rows per expert."""
    gmm = torch._grouped_mm
    rows = T * K
    per = rows // E
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * per
    bf = torch.bfloat16
    x = torch.randn(rows, H, device=dev, dtype=bf)          # gathered hidden, expert order
    dO = torch.randn(rows, H, device=dev, dtype=bf)
    dz = torch.randn(rows, 2 * I, device=dev, dtype=bf)
    a = torch.randn(rows, I, device=dev, dtype=bf)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=bf) * 0.02
    out = {}
    calls = {
        "gate_up": lambda: gmm(x, w13.transpose(1, 2), offs=offs),    # [rows, 2I]
        "down": lambda: gmm(a, w2.transpose(1, 2), offs=offs),        # [rows, H]
        "dA": lambda: gmm(dO, w2, offs=offs),                         # [rows, I]
        "dx": lambda: gmm(dz, w13, offs=offs),                        # [rows, H]
        # weight gradients: contraction over each expert's rows (offs on the shared dim)
        "dW13": lambda: gmm(dz.t(), x, offs=offs),                    # [E, 2I, H]
        "dW2": lambda: gmm(dO.t(), a, offs=offs),                     # [E, H, I]
    }
    # the same weight gradients with contiguous (row-major) left operands, in case the
    # transposed views are not a layout torch._grouped_mm takes
    dzt, dOt = dz.t().contiguous(), dO.t().contiguous()
    fallback = {"dW13": lambda: gmm(dzt, x, offs=offs), "dW2": lambda: gmm(dOt, a, offs=offs)}
    for name, fn in calls.items():
        try:
            out[name] = best_ms(fn)
        except Exception as exc:  # noqa: BLE001 - a layout torch does not take: say so
            out[name] = f"{type(exc).__name__}: {str(exc)[:80]}"
            if name in fallback:
                try:
                    out[name] = best_ms(fallback[name])
                    print(f"  ({name}: transposed view refused, timed on a row-major copy)")
                except Exception as exc2:  # noqa: BLE001
                    out[name] += f" / {type(exc2).__name__}: {str(exc2)[:80]}"
        torch.cuda.empty_cache()
    return out


def gemm_flops(H, I, E, K, T) -> dict:
    r = T * K
    return {"gate_up": 2 * r * H * 2 * I, "down": 2 * r * I * H, "dA": 2 * r * H * I,
            "dx": 2 * r * 2 * I * H, "dW13": 2 * r * 2 * I * H, "dW2": 2 * r * H * I}


def moe_ops_kernels(H, I, E, K, T, dev, cell=None) -> tuple[dict, dict]:
    """(forward kernel ms, backward kernel ms) per name, z saved; uniform routing, or with
    `cell` the benchmark's own inputs and routing for that cell (bench.cell_inputs)."""
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    if cell is None:
        hidden = torch.randn(T, H, device=dev, dtype=bf, generator=g)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=bf, generator=g) * 0.02
        w2 = torch.randn(E, H, I, device=dev, dtype=bf, generator=g) * 0.02
        t = torch.arange(T, device=dev)[:, None] * K + torch.arange(K, device=dev)[None, :]
        ids = (t % E).to(torch.int32)
        w = torch.rand(T, K, device=dev, generator=g)
    else:
        ci = bench.cell_inputs(cell, dev, bf)
        hidden, w13, w2 = ci.hidden, ci.weights.w13, ci.weights.w2
        w, ids = ci.topk_weights, ci.topk_ids
    grad = torch.randn(T, H, device=dev, dtype=bf, generator=g)
    _, z = dispatch_triton(hidden, w13, w2, w, ids, save_z=True)
    fwd = lambda: dispatch_triton(hidden, w13, w2, w, ids, save_z=True)  # noqa: E731
    bwd = lambda: dispatch_backward_triton(grad, hidden, w13, w2, w, ids, z=z)  # noqa: E731
    fwd(), bwd()
    torch.cuda.synchronize()
    kf = {k: v / 1000 for k, v in bench.kernel_times_us(fwd, 5).items()}
    kb = {k: v / 1000 for k, v in bench.kernel_times_us(bwd, 5).items()}
    return kf, kb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="*", default=["qwen3_30b_a3b:2048", "qwen3_30b_a3b:8192",
                                                  "olmoe:2048", "deepseek_v3_routed:8192",
                                                  "mixtral_8x7b:8192"])
    p.add_argument("--bench-routing", nargs="*", default=[],
                   help="cells (e.g. qwen3_30b_a3b_zipf:8192) whose moe_ops kernels are also "
                        "timed with the benchmark's routing, beside the uniform cell of the "
                        "same shape and T")
    p.add_argument("--vendor", action=argparse.BooleanOptionalAction, default=True,
                   help="time torch._grouped_mm (--no-vendor: moe_ops' kernels only)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_ceilings.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    # the bench's own ceilings (best of three each: 1 GiB copy, bf16 8192^3 matmul)
    cp, mm, _ = bench.measure_ceilings(dev, bench.Timer(dev, 10, 50), tiny=False)
    l2 = l2_read_bandwidth(dev)
    print(f"ceilings: bf16 8192^3 matmul {mm / 1e12:.1f} TFLOP/s, copy {cp / 1e12:.2f} TB/s "
          f"(read + write), L2 reads {l2 / 1e12:.2f} TB/s", flush=True)
    rows = []
    for cell in args.cells:
        name, T = cell.split(":")
        T = int(T)
        H, I, E, K = SHAPES[name]
        vend = vendor_gemms(H, I, E, K, T, dev) if args.vendor else {}
        fl = gemm_flops(H, I, E, K, T)
        kf, kb = moe_ops_kernels(H, I, E, K, T, dev)
        print(f"\n## {cell} (uniform, {T * K // E} rows per expert)")
        print("vendor torch._grouped_mm, ms (TFLOP/s, % of the matmul ceiling):")
        for k, v in vend.items():
            if isinstance(v, float):
                print(f"  {k:8s} {v:8.3f}  ({fl[k] / v / 1e9:6.1f}, {fl[k] / v / 1e9 / (mm / 1e12) * 100:5.1f}%)")
            else:
                print(f"  {k:8s} {v}")
        print("moe_ops forward kernels (z saved), ms: " +
              ", ".join(f"{k} {v:.3f}" for k, v in kf.items()))
        print("moe_ops backward kernels, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in kb.items()))
        for bcell in [c for c in args.bench_routing if c.split(":")[0].startswith(name)
                      and int(c.split(":")[1]) == T]:
            bf_, bb_ = moe_ops_kernels(H, I, E, K, T, dev, cell=bcell)
            print(f"moe_ops with the bench's routing ({bcell}): forward {sum(bf_.values()):.3f} "
                  f"ms, backward {sum(bb_.values()):.3f} ms (uniform: {sum(kf.values()):.3f}, "
                  f"{sum(kb.values()):.3f}); forward " +
                  ", ".join(f"{k} {v:.3f}" for k, v in bf_.items()) + "; backward " +
                  ", ".join(f"{k} {v:.3f}" for k, v in bb_.items()))
        ok = bool(vend) and all(isinstance(vend[k], float) for k in vend)
        if ok:
            gu_v, dn_v = vend["gate_up"], vend["down"]
            rowv = vend["dA"] + vend["dx"]
            wgv = vend["dW13"] + vend["dW2"]
            gu_m = kf.get("gate_up_kernel", float("nan"))
            dn_m = kf.get("down_kernel", float("nan"))
            row_m = kb.get("down_kernel", float("nan"))
            wg_m = sum(v for k, v in kb.items() if k.startswith("weight_grad"))
            rows.append((cell, gu_m, gu_v, dn_m, dn_v, row_m, rowv, wg_m, wgv))
        torch.cuda.empty_cache()
    print("\n| cell | gate+up moe_ops / vendor ms | down | dA+dx | dW13+dW2 |")
    print("|---|---|---|---|---|")
    for c, a, b, d, e, f, g_, h, i in rows:
        print(f"| {c} | {a:.3f} / {b:.3f} | {d:.3f} / {e:.3f} | {f:.3f} / {g_:.3f} | "
              f"{h:.3f} / {i:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
