"""How fast can the H200 read HBM, against the copy rate the floors use?

The forward floors (moe_ops.bench) divide the weight bytes by the measured device-to-device copy
rate (read + write). Decode is a pure weight *read*: if a read-only stream runs faster than the
copy rate, the decode GEMMs (94-96% of the copy rate, NOTES.md entry 58) have that much headroom;
if not, they are at the stream's ceiling. This probe measures, on one large buffer (far past
L2): the copy rate as the bench measures it; torch's sum (a tuned read-only reduction); a Triton
read kernel with plain vector loads over a grid of programs per SM; and a Triton read kernel that
streams [BLOCK_R, BLOCK_C] tiles through tensor descriptors (TMA) in a pipelined loop, like the
decode GEMMs' weight tiles. Prints a table (TB/s and the ratio to the copy rate).

    python benchmarks/probe_dram_read.py [--gib 2]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(src, out, n, chunk, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, chunk, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(src + idx, mask=idx < n, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def _tma_read_kernel(src, out, rows, cols, rows_per_prog, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    desc = tl.make_tensor_descriptor(src, shape=[rows, cols], strides=[cols, 1],
                                     block_shape=[BLOCK_R, BLOCK_C])
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    r0 = pid * rows_per_prog
    n_c = cols // BLOCK_C
    steps = (rows_per_prog // BLOCK_R) * n_c
    for s in tl.range(0, steps, num_stages=STAGES):
        r = r0 + (s // n_c) * BLOCK_R
        c = (s % n_c) * BLOCK_C
        acc += desc.load([r, c]).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def _bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200)  # ms, median


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    n = int(args.gib * 2**30) // 2
    cols = 2048
    n -= n % (cols * 128 * sms)
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    rows = []

    copy_ms = _bench(lambda: y.copy_(x))
    copy_rate = 2 * nbytes / copy_ms / 1e9
    rows.append(("copy (read+write, the floors' rate)", copy_rate))
    rows.append(("torch.sum (read)", nbytes / _bench(lambda: x.sum(dtype=torch.float32)) / 1e9))

    out = torch.empty(sms * 16, device=dev, dtype=torch.float32)
    for per_sm in (1, 2, 4, 8):
        for block in (2048, 8192):
            progs = sms * per_sm
            chunk = triton.cdiv(triton.cdiv(n, progs), block) * block
            for warps in (4, 8):
                ms = _bench(lambda: _read_kernel[(progs,)](x, out, n, chunk, BLOCK=block,
                                                           num_warps=warps))
                rows.append((f"tl.load .cg, {per_sm}/SM, BLOCK {block}, {warps} warps",
                             nbytes / ms / 1e9))

    R = n // cols
    for per_sm in (1, 2):
        progs = sms * per_sm
        for br, bc, stages in ((64, 128, 4), (64, 256, 4), (128, 128, 4), (64, 128, 8),
                               (32, 256, 6), (16, 256, 8)):
            rows_per_prog = R // progs // br * br
            used = progs * rows_per_prog * cols * 2
            ms = _bench(lambda: _tma_read_kernel[(progs,)](x, out, R, cols, rows_per_prog,
                                                           BLOCK_R=br, BLOCK_C=bc, STAGES=stages,
                                                           num_warps=4))
            rows.append((f"TMA [{br}, {bc}] x {stages} stages, {per_sm}/SM", used / ms / 1e9))

    print(f"\nbuffer {nbytes / 2**30:.2f} GiB bf16, {sms} SMs")
    print(f"{'method':48s} {'TB/s':>6s} {'/copy':>6s}")
    for name, rate in rows:
        print(f"{name:48s} {rate:6.3f} {rate / copy_rate:6.3f}")   # bytes / ms / 1e9 = TB/s
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
