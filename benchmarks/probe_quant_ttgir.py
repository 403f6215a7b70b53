"""Compile the quantized gate+up / down kernels for sm_90 on a machine without a GPU (Triton's
bundled ptxas) with the specialisation a real launch at gpt-oss-20b's shape gets, and print which
loads of the K loop Triton's pipeliner made asynchronous, the shared memory, the registers and
spills. PYTHONPATH=.:[a Triton --target dir] python benchmarks/probe_quant_ttgir.py BLOCK_M BLOCK_K
DIRECT PREFETCH (e.g. 16 128 1 1: decode; 128 64 0 1: prefill)."""
import inspect
import os
import re  # noqa: F401
import subprocess
import sys

import triton
import triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget

def compile_for(K, ptr_types, ints, const, num_warps=4, num_stages=3, cap=90):
    names = list(inspect.signature(K.fn).parameters)
    sig, consts, attrs = {}, dict(const), {}
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr_types:
            sig[n] = ptr_types[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            v = ints.get(n, 7)
            if isinstance(v, float):
                sig[n] = "fp32"
            elif v == 1:
                sig[n] = "constexpr"; consts[n] = 1
            else:
                sig[n] = "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(K, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", cap, 128),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


PTX = "/tmp/probe_quant_ttgir.ptx"
from moe_ops.kernels.quant_gemm import quant_gate_up_kernel as K
H = I = 2880; E = 32
bm, bk, direct = int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3]))
ptr = {n: "*i32" for n in ["sorted_ptr", "block_expert_ptr", "num_rows_ptr", "ids_ptr"]}
ptr.update(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", bias_ptr="*bf16", tw_ptr="*fp32", act_ptr="*bf16",
           act_scale_ptr="*bf16", xs_ptr="*bf16")
ints = dict(n_slots=4 if direct else 8192, H=H, I=I, top_k=4, n_row_blocks=4 if direct else 300, scale_bn=1,
            alpha=1.702, limit=7.0, stride_xt=H, stride_xh=1, stride_we=2*I*H//2, stride_wn=H//2, stride_wk=1,
            stride_se=2*I*H//32, stride_sn=H//32, stride_sk=1, stride_be=2*I, stride_bn=1, stride_tw_t=4,
            stride_tw_k=1, stride_am=I, stride_as=I, stride_ik=1, n_experts=E, stride_xs=H)
const = dict(WFMT=2, QUANT_A=False, ACTIVATION=4, INTERLEAVED=True, HAS_BIAS=True, WEIGHTS_ON_INPUT=False,
             EMULATE=False, OP_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk,
             GROUP_M=8, DIRECT=direct, A_PREQUANT=False, SCALAR_SCALE=False, BIT_DECODE=2, SWAP_AB=True,
             ACT_F32=False, EVEN_K=True, PREFETCH_SCALES=bool(int(sys.argv[4])))
ck = compile_for(K, ptr, ints, const, num_stages=3)
open(PTX, "w").write(ck.asm["ptx"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", PTX, "-o", PTX + ".cubin"], capture_output=True, text=True)
g = ck.asm["ttgir"]
print("gate_up", bm, bk, "async", g.count("async_copy_global_to_local"), "loads", g.count("tt.load"), "smem", ck.metadata.shared,
      [l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l])
