"""Host side of the Triton backward of moe.dispatch (kernels: moe_ops.kernels.expert_gemm_backward).

The forward's alignment is recomputed (deterministic, a few small launches). The pre-activation
z = W13_e x is either saved by the training forward (`z`, [T*K, 2I] in the input dtype: 2*K*I
elements per token, see dispatch_triton(save_z=True)) or recomputed here (the forward's gate+up GEMM,
2/3 of the forward's flops, into a z scratch that lives only during this layer's backward: no
activation memory is kept between forward and backward).
Scratch during backward, per aligned row: hidden and grad_out gathered into row order [2H], dz
[2I] + s*a [I] in the input dtype, dA [I] in float32 (in the input dtype with
BackwardConfig.da_half) and the per-slot dx [H] in the input dtype."""
from __future__ import annotations

import torch

from moe_ops._runtime import cdiv, kernel_for, next_pow2
from moe_ops.kernels.expert_gemm_backward import (gather_rows_kernel, swiglu_grad_kernel,
                                                  weight_grad_kernel,
                                                  weight_grad_persistent_kernel,
                                                  weight_grad_ws_kernel)
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.dispatch import (_dot_precision, combine_triton, gate_up_triton, launch_ws,
                                     num_programs, rows_gemm_triton, tma_layout_ok, weight_desc)
from moe_ops.launch.fast import launch_key, tensor_key
from moe_ops.tuning.heuristics import backward_config, dispatch_config


def dispatch_backward_triton(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation="silu",
                             z=None, config=None, bwd_config=None, *, w13_bias=None, w2_bias=None,
                             alpha=1.702, limit=7.0, gate_up_interleaved=False,
                             weights_on_input=False):
    """`z`: the pre-activation [T*K, 2I] saved by the training forward (None: recompute it)."""
    if (activation != "silu" or w13_bias is not None or w2_bias is not None
            or gate_up_interleaved or weights_on_input):
        raise NotImplementedError("moe.dispatch variants in the Triton kernels")
    T, H = hidden.shape
    E, I = w2.shape[0], w2.shape[2]
    K = topk_ids.shape[1]
    dev = hidden.device
    dt = hidden.dtype
    dx = torch.empty(T, H, dtype=dt, device=dev)
    dw13 = torch.empty(w13.shape, dtype=w13.dtype, device=dev)
    dw2 = torch.empty(w2.shape, dtype=w2.dtype, device=dev)
    dweights = torch.zeros(topk_weights.shape, dtype=topk_weights.dtype, device=dev)
    if T * K == 0 or E == 0:   # no slot reaches an expert: every gradient is zero
        return dx.zero_(), dw13.zero_(), dw2.zero_(), dweights
    cfg = config or dispatch_config(T, E, K, H, I, dev.type, dt)
    bc = bwd_config or backward_config(cfg, dev.type, dt, rows_per_expert=T * K / E,
                                        inter_size=I)
    if z is not None and tuple(z.shape) != (T * K, 2 * I):
        raise ValueError(f"saved z has shape {tuple(z.shape)}, expected {(T * K, 2 * I)}")
    # Every argument of this call's launches is a function of this key and of the buffers each
    # launch names in its launch_key (moe_ops.launch.fast: Triton's per-launch binding skipped).
    key = (cfg, bc, tensor_key(grad_out), tensor_key(hidden), tensor_key(w13), tensor_key(w2),
           tensor_key(topk_weights), tensor_key(topk_ids), z is None or tensor_key(z),
           tuple(t.data_ptr() % 16 for t in (dx, dw13, dw2, dweights))) \
        if dev.type == "cuda" else None
    al = align_triton(topk_ids, E, cfg.block_m)
    n_slots = T * K
    prec = _dot_precision(dt)
    stages = bc.num_stages

    xs = gather_rows_triton(hidden, al, n_slots, K, key=key and (key, "x"))
    gos = gather_rows_triton(grad_out, al, n_slots, K, key=key and (key, "dO"))
    dz = torch.empty(al.max_rows, 2 * I, dtype=dt, device=dev)
    sa = torch.empty(al.max_rows, I, dtype=dt, device=dev)
    # dA = dO W2_e as a plain grouped GEMM (float32 out, per slot), then one elementwise pass
    # over dA and z.
    if z is None:   # recompute: the forward's gate+up GEMM; z lives only during this call
        z = torch.empty(n_slots, 2 * I, dtype=dt, device=dev)
        gate_up_triton(hidden, w13, sa, al, cfg, n_slots, K, z=z, key=key and (key, "z"))
    dA = torch.empty(n_slots, I, dtype=dt if bc.da_half else torch.float32, device=dev)
    rows_gemm_triton(gos, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), dA, al, I, H,
                     n_slots, K, bc.da_n, bc.da_k, bc.da_warps, stages, tma=bc.tma,
                     tma_a=bc.tma_a, half_tail=bc.half_tail, key=key and (key, "dA"),
                     ws=bc.rows_ws)
    block_i = min(bc.ew_i, next_pow2(I))
    fk = launch_key(key and (key, "swiglu"), dA, z, al.sorted_slots, al.num_rows, dz, sa)
    kernel_for(swiglu_grad_kernel, dev, fk)[(cdiv(al.max_rows, bc.ew_r),)](
        dA, z, topk_weights, al.sorted_slots, al.num_rows, dz, sa, dweights,
        n_slots, I, K, dA.stride(0), z.stride(0), topk_weights.stride(0),
        topk_weights.stride(1), dz.stride(0), sa.stride(0), dweights.stride(0),
        dweights.stride(1),
        BLOCK_R=bc.ew_r, BLOCK_I=block_i, num_warps=4,
    )
    del dA, z   # a recomputed z is freed here, before the weight-gradient GEMMs

    # dW2_e [H, I] = sum_rows dO[t]^T (s a)[row];  dW13_e [2I, H] = sum_rows dz[row]^T x[t]
    weight_grad_triton(gos, sa, dw2, al, bc, prec, key=key and (key, "dW2"))
    del gos
    weight_grad_triton(dz, xs, dw13, al, bc, prec, key=key and (key, "dW13"))
    del xs

    # dx: per-slot dz[row] @ W13_e ([2I] x [2I, H]), then the forward's deterministic combine.
    dxs = torch.empty(n_slots, H, dtype=dt, device=dev)
    rows_gemm_triton(dz, w13, (w13.stride(0), w13.stride(2), w13.stride(1)), dxs, al, H, 2 * I,
                     n_slots, K, bc.dx_n, bc.dx_k, bc.dx_warps, stages, tma=bc.tma,
                     tma_a=bc.tma_a, half_tail=bc.half_tail, key=key and (key, "dx"),
                     ws=bc.rows_ws)
    combine_triton(dxs, topk_ids, dx, E, key=key and (key, "dx"))
    return dx, dw13, dw2, dweights


def gather_rows_triton(src, al, n_slots, top_k, key=None):
    """src rows in aligned-row order ([max_rows, H]; padding rows zero, rows past the device-side
    row count left unwritten: no kernel reads them). `key`: the fast-launch key of the call (a
    function of src and the alignment's shapes), or None."""
    H = src.shape[1]
    dst = torch.empty(al.max_rows, H, dtype=src.dtype, device=src.device)
    block_r = 16
    fk = launch_key(key, dst, al.sorted_slots, al.num_rows)
    kernel_for(gather_rows_kernel, src.device, fk)[(cdiv(al.max_rows, block_r),)](
        src, al.sorted_slots, al.num_rows, dst, n_slots, top_k, H,
        src.stride(0), src.stride(1), dst.stride(0),
        BLOCK_R=block_r, BLOCK_H=min(512, next_pow2(H)), num_warps=4,
    )
    return dst


def weight_grad_triton(left, right, out, al, bc, prec, key=None):
    """out[e] ([M, N]) = sum over expert e's aligned rows of left[row]^T right[row] (up to the
    first step past its valid rows); left and right are contiguous, in aligned-row order, with
    zero padding rows."""
    E, M, N = out.shape
    bk = min(bc.wg_k, al.block_m)
    ends = al.expert_ends
    if al.valid_ends.data_ptr() != ends.data_ptr() + E * ends.element_size():
        raise ValueError("weight_grad_triton needs an alignment whose valid ends follow its "
                         "padded ends in one buffer (align_triton's)")
    if al.block_m % bk:
        raise ValueError(f"weight-gradient step {bk} must divide block_m {al.block_m}")
    if bc.wg_ws and bc.wg_trim and _weight_grad_ws(left, right, out, al, bc, prec, bk):
        return
    fk = launch_key(key, left, right, out, al.expert_ends)
    if bc.wg_persistent and bc.wg_trim and _weight_grad_persistent(left, right, out, al, bc, prec,
                                                                   bk, fk):
        return
    kernel_for(weight_grad_kernel, out.device, fk)[
            (E * cdiv(M, bc.wg_m) * cdiv(N, bc.wg_n),)](
        left, right, out, al.expert_ends, M, N, E,
        left.stride(0), right.stride(0), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=bc.wg_m, BLOCK_N=bc.wg_n, BLOCK_K=bk, DOT_PRECISION=prec, TRIM=bc.wg_trim,
        num_warps=bc.wg_warps, num_stages=bc.num_stages,
    )


def _weight_grad_persistent(left, right, out, al, bc, prec, bk, fk=None) -> bool:
    """weight_grad_triton on the persistent kernel, if it applies: 16-bit operands whose tensor
    descriptors are legal here (weight_desc: 16-byte aligned rows, sm_90+ or the interpreter) and
    output block indices that fit the kernel's packed int32 (< 2^15 row blocks, < 2^16 column
    blocks). Returns whether it ran."""
    if not (1 <= bc.wg_chunk <= 32 and bc.wg_chunk & (bc.wg_chunk - 1) == 0):
        raise ValueError(f"BackwardConfig.wg_chunk must be a power of two in [1, 32], got "
                         f"{bc.wg_chunk}")
    if not (isinstance(bc.wg_per_sm, int) and bc.wg_per_sm >= 1):
        raise ValueError(f"BackwardConfig.wg_per_sm must be an int >= 1, got {bc.wg_per_sm!r}")
    if bc.wg_split not in (1, 2, 4):
        raise ValueError(f"BackwardConfig.wg_split must be 1, 2 or 4, got {bc.wg_split}")
    if left.dtype not in (torch.bfloat16, torch.float16):
        return False
    E, M, N = out.shape
    if cdiv(M, bc.wg_m) >= 1 << 15 or cdiv(N, bc.wg_n) >= 1 << 16:
        return False
    split = bc.wg_split if bc.wg_n % (16 * bc.wg_split) == 0 else 1
    descs = (weight_desc(left, [bk, bc.wg_m]), weight_desc(right, [bk, bc.wg_n]),
             weight_desc(out, [1, bc.wg_m, bc.wg_n // split]))
    if any(d is None for d in descs):
        return False
    n_tiles = E * cdiv(M, bc.wg_m) * cdiv(N, bc.wg_n)
    programs = min(num_programs(out.device) * bc.wg_per_sm, n_tiles)
    # largest experts' tiles first, dealt in snaking rounds (the kernel's LPT): up to
    # LPT_MAX_EXPERTS, as every program ranks all experts once
    block_e = next_pow2(E)
    lpt = bc.wg_lpt and E > 1 and block_e <= LPT_MAX_EXPERTS
    order = torch.empty(programs, block_e, dtype=torch.int32, device=out.device) if lpt else None
    fk = fk and fk + (lpt, LPT_SORT, LPT_SNAKE, LPT_MIN_SKEW,
                      order is None or order.data_ptr() % 16)
    kernel_for(weight_grad_persistent_kernel, out.device, fk)[(programs,)](
        *descs, al.expert_ends, M, N, E, left.shape[0],
        BLOCK_M=bc.wg_m, BLOCK_N=bc.wg_n, BLOCK_K=bk, CHUNK=bc.wg_chunk, SPLIT=split,
        NUM_PROGRAMS=programs, DOT_PRECISION=prec, order_ptr=order, LPT=lpt,
        BLOCK_E=block_e if lpt else 1, LPT_SORT=LPT_SORT, LPT_SNAKE=LPT_SNAKE,
        LPT_MIN_SKEW=LPT_MIN_SKEW,
        num_warps=bc.wg_warps, num_stages=bc.wg_stages or bc.num_stages,
    )
    return True


LPT_MAX_EXPERTS = 512
# The LPT schedule's two parts, switchable for measurements (benchmarks/ab_wg_schedule.py): the
# experts ranked by rows (else in index order) and the snaking deal (else round robin).
LPT_SORT = True
LPT_SNAKE = True
# ... and both only where the largest expert has more than this many times the mean rows (the
# kernel tests it at run time; the snaking deal costs 3-9% on near-uniform routing: NOTES.md 53)
LPT_MIN_SKEW = 2


def _weight_grad_ws(left, right, out, al, bc, prec, bk) -> bool:
    """weight_grad_triton on the warp-specialised persistent kernel, if it applies: a GPU with
    tensor memory access (sm_90+) or the interpreter (the CPU tests run it there), 16-bit
    operands with 16-byte aligned rows, M a multiple of the tile's rows (the output is stored
    through an [E*M, N] view) and at most 4 pipeline stages (at 5, 128x128x64 tiles, Triton 3.6
    compiles a kernel that leaves whole output tiles unwritten: benchmarks/NOTES.md, entry 24).
    Returns whether it ran."""
    E, M, N = out.shape
    stages = bc.wg_stages or bc.num_stages
    if left.dtype not in (torch.bfloat16, torch.float16) or M % bc.wg_m or stages > 4:
        return False
    # (out is stored through an [E*M, N] view: contiguous)
    if not (out.is_contiguous() and all(tma_layout_ok(t) for t in (left, right, out))):
        return False
    n_tiles = E * (M // bc.wg_m) * cdiv(N, bc.wg_n)
    programs = min(num_programs(out.device), n_tiles)
    return launch_ws(
        weight_grad_ws_kernel, out.device, (programs,), (bc.wg_m, bc.wg_n, bk, stages, left.dtype),
        left, right, out, al.expert_ends, M, N, E, left.shape[0], left.stride(0), right.stride(0),
        BLOCK_M=bc.wg_m, BLOCK_N=bc.wg_n, BLOCK_K=bk, NUM_PROGRAMS=programs,
        DOT_PRECISION=prec, num_warps=4, num_stages=stages,
    )
