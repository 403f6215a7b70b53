"""A minimal warp-specialised Triton GEMM checked beside another GPU process (not part of the
test suite): the smallest reproducer of benchmarks/NOTES.md entry 28 (moe_ops' WS kernels write
NaN / stale values whenever another process uses the GPU; the same loops without the WS pass do
not). A persistent C = A @ B^T over 128x128 tiles with tensor descriptors made in the kernel
and `tl.range(..., warp_specialize=WS)`, as Triton's persistent-matmul tutorial; every run is
compared bitwise with the first and against cuBLAS, with a process running matmuls beside it
(--noise 1) or not (--noise 0).

    PYTHONPATH=. python benchmarks/ws_repro.py --ws on --noise 1 --seconds 15
    PYTHONPATH=. python benchmarks/ws_repro.py --ws on --noise 1 --maxnreg 128   # less reallocation

If it fails with --ws on and --noise 1 only, it is a Triton report with this file.
--desc host passes host-made descriptors instead of making them in the kernel (tells a
device-descriptor visibility problem from one of the warp-specialised code itself); runs
alternate between --sets input pairs, each compared with its own first result (a stale
descriptor or tile from the other set would then show as a wrong, finite value).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

@triton.jit
def _ws_gemm(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WS: tl.constexpr,
             HOST_DESC: tl.constexpr):
    if HOST_DESC:   # a_ptr and b_ptr are host-made descriptors
        a_desc = a_ptr
        b_desc = b_ptr
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    n_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * n_n, NUM_PROGRAMS,
                         warp_specialize=WS):
        m0 = (tile // n_n) * BLOCK_M
        n0 = (tile % n_n) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([m0, k0]), tl.trans(b_desc.load([n0, k0])), acc)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(tl.bfloat16),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ws", choices=["on", "off"], default="on")
    p.add_argument("--noise", type=int, default=1, help="processes running matmuls beside it")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--size", type=int, default=4096, help="M = N = K")
    p.add_argument("--maxnreg", type=int, default=None, help="Triton's maxnreg launch option")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--desc", choices=["device", "host"], default="device")
    p.add_argument("--sets", type=int, default=2, help="input pairs the runs alternate between")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ws_repro.py needs a CUDA GPU", file=sys.stderr)
        return 2
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    n = a.size
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [(torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g),
             torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g))
            for _ in range(a.sets)]
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    extra = {"maxnreg": a.maxnreg} if a.maxnreg else {}
    host = a.desc == "host"
    if host:
        from triton.tools.tensor_descriptor import TensorDescriptor

    def run(i):
        x, w = sets[i % len(sets)]
        if host:
            x = TensorDescriptor.from_tensor(x, [128, 64])
            w = TensorDescriptor.from_tensor(w, [128, 64])
        c = torch.full((n, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        _ws_gemm[(programs,)](x, w, c, n, n, n, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                              NUM_PROGRAMS=programs, WS=a.ws == "on", HOST_DESC=host,
                              num_warps=4, num_stages=a.stages, **extra)
        return c

    firsts = [run(i) for i in range(len(sets))]
    refs = [x.float() @ w.float().t() for x, w in sets]
    err = max(float((f.float() - r).abs().max() / r.abs().max()) for f, r in zip(firsts, refs))
    refs = None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ws_stress import start_noise   # the same noise processes as ws_stress.py's

    noise = start_noise(a.noise, 24 * 3600.0)
    try:
        runs = bad = nan = 0
        t_end = time.time() + a.seconds
        while time.time() < t_end:
            c = run(runs)
            nan += bool(torch.isnan(c).any())
            bad += not torch.equal(c, firsts[runs % len(sets)])
            runs += 1
    finally:
        for q in noise:
            q.kill()
            q.wait()
    print(f"WS {a.ws}, {a.desc} descriptors, maxnreg {a.maxnreg}, stages {a.stages}, "
          f"{len(sets)} input sets, {a.noise} noise, size {n}: first "
          f"run rel err vs float32 {err:.1e}; {runs} runs, {nan} with NaN, {bad} not bitwise "
          f"equal to the first")
    return 1 if (bad or nan or not err < 2e-2) else 0


if __name__ == "__main__":
    sys.exit(main())
