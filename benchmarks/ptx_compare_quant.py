"""PTX of the FP8 W8A8 quantized kernels (gate+up and down, DeepSeek-V3 specialisation, scale
prefetch on and off), compiled for sm_90 on a machine without a GPU, written to DIR; compare two
trees' output with the debug lines (.loc, .file, $L__tmp labels, debug sections) removed to show
that a refactor leaves the code unchanged.

    PYTHONPATH=.:[a Triton --target dir] python benchmarks/ptx_compare_quant.py DIR
"""
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


import triton.language as tl
from moe_ops.kernels.quant_gemm import quant_gate_up_kernel, quant_down_kernel
H, I, E = 7168, 2048, 256
out = sys.argv[1]
for pf in (True, False):
    common = dict(WFMT=1, QUANT_A=True, EMULATE=False, OP_DTYPE=tl.bfloat16, DOT_PRECISION="tf32",
                  BLOCK_K=128, GROUP_M=8, DIRECT=False, SCALAR_SCALE=True, BIT_DECODE=0, SWAP_AB=False,
                  EVEN_K=True, PREFETCH_SCALES=pf)
    ptr = {n: "*i32" for n in ["sorted_ptr", "block_expert_ptr", "num_rows_ptr", "ids_ptr"]}
    ptr.update(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", s_ptr="*fp32", bias_ptr="*fp8e4nv", tw_ptr="*fp32",
               act_ptr="*fp8e4nv", act_scale_ptr="*fp32", xs_ptr="*fp32")
    ints = dict(n_slots=65536, H=H, I=I, top_k=8, n_row_blocks=1300, scale_bn=128, alpha=1.702, limit=7.0,
                stride_xt=H, stride_xh=1, stride_we=2*I*H, stride_wn=H, stride_wk=1, stride_se=16*56,
                stride_sn=56, stride_sk=1, stride_be=2*I, stride_bn=1, stride_tw_t=8, stride_tw_k=1,
                stride_am=I, stride_as=16, stride_ik=1, n_experts=E, stride_xs=56)
    const = dict(common, ACTIVATION=0, INTERLEAVED=False, HAS_BIAS=False, WEIGHTS_ON_INPUT=False,
                 BLOCK_M=64, BLOCK_N=128, A_PREQUANT=True, ACT_F32=False)
    ck = compile_for(quant_gate_up_kernel, ptr, ints, const, num_warps=8, num_stages=4)
    open(f"{out}/gate_up_pf{int(pf)}.ptx", "w").write(ck.asm["ptx"])
    ptr = {n: "*i32" for n in ["sorted_ptr", "block_expert_ptr", "num_rows_ptr", "ids_ptr"]}
    ptr.update(act_ptr="*fp8e4nv", w_ptr="*fp8e4nv", s_ptr="*fp32", bias_ptr="*fp8e4nv", tw_ptr="*fp32",
               y_ptr="*bf16", act_scale_ptr="*fp32")
    ints = dict(n_slots=65536, H=H, I=I, top_k=8, n_row_blocks=1300, scale_bn=128, stride_am=I,
                stride_we=H*I, stride_wn=I, stride_wk=1, stride_se=56*16, stride_sn=16, stride_sk=1,
                stride_be=H, stride_bn=1, stride_tw_t=8, stride_tw_k=1, stride_ym=H, stride_as=16,
                stride_ik=1, n_experts=E)
    const = dict(common, HAS_BIAS=False, HAS_WEIGHTS=True, BLOCK_M=64, BLOCK_N=128, QUANT_GATHER=False)
    ck = compile_for(quant_down_kernel, ptr, ints, const, num_warps=8, num_stages=4)
    open(f"{out}/down_pf{int(pf)}.ptx", "w").write(ck.asm["ptx"])
print("ok")
