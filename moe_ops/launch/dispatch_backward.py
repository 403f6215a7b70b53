"""Host side of the Triton backward of moe.dispatch (kernels: moe_ops.kernels.expert_gemm_backward).

The forward's alignment is recomputed (deterministic, a few small launches). The pre-activation
z = W13_e x is either saved by the training forward (`z`, [T*K, 2I] in the input dtype: 2*K*I
elements per token, see dispatch_triton(save_z=True)) or recomputed here (the forward's gate+up GEMM,
2/3 of the forward's flops, into a z scratch that lives only during this layer's backward: no
activation memory is kept between forward and backward).
Scratch during backward, per aligned row: hidden and grad_out gathered into row order [2H], dz
[2I] + s*a [I] in the input dtype, dA [I] in float32 and the per-slot dx [H] in the input
dtype."""
from __future__ import annotations

import torch

from moe_ops._runtime import cdiv, next_pow2
from moe_ops.kernels.expert_gemm import ACT_CODES
from moe_ops.kernels.expert_gemm_backward import (act_grad_kernel, expert_colsum_kernel,
                                                  gather_rows_kernel, swiglu_grad_kernel,
                                                  weight_grad_kernel,
                                                  weight_grad_persistent_kernel)
from moe_ops.launch._common import dot_precision, kernel_for, num_programs, weight_desc
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.dispatch import (Variant, combine_triton, gate_up_triton, rows_gemm_triton,
                                     same_view)
from moe_ops.launch.fast import launch_key, tensor_key
from moe_ops.reference.dispatch import empty_grad
from moe_ops.tuning.configs import WeightGradConfig
from moe_ops.tuning.heuristics import backward_config, dispatch_config


def x_chunks(bc, H: int, x_bytes: int, dz_bytes: int) -> int:
    """Column chunks of H for dW13's gathered x (BackwardConfig.x_chunks; 0, the default: two
    where gathered x is more than half of dz and H splits into halves that are multiples of
    128, else one. Each chunk reads dz once more: at Qwen3-30B-A3B T = 8192 on the H100 two
    chunks kept the step's time (62% of the roofline against 61%) and lowered its peak 1.92 ->
    1.77 GiB, four reached 1.69 GiB at 0.89x the speed). More than one chunk must split H into
    equal widths that are multiples of 8 (16-byte aligned column offsets), else a ValueError."""
    n = bc.x_chunks
    if n == 0:
        n = 2 if x_bytes > dz_bytes / 2 and H % 256 == 0 else 1
    if n < 1 or (n > 1 and (H % n or (H // n) % 8)):
        raise ValueError(f"BackwardConfig.x_chunks = {bc.x_chunks} must split H = {H} into equal "
                         f"widths that are multiples of 8 (or be 0: automatic)")
    return n


def dispatch_backward_triton(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation="silu",
                             z=None, config=None, bwd_config=None, *, w13_bias=None, w2_bias=None,
                             alpha=1.702, limit=7.0, gate_up_interleaved=False,
                             weights_on_input=False, w3=None):
    """`z`: W13_e x per slot [T*K, 2I] saved by the training forward (None: recompute it).
    Returns (d hidden, d w13, d w2, d topk_weights), and (d w13_bias, d w2_bias) after them (None
    for an absent bias) when a bias is given, then d w3 when w3 (the up projection apart from
    the gate w13 [E, I, H]) is given. Weight gradients have the weights' strides where
    those are a permutation of dense storage (a transposed checkpoint view), else contiguous."""
    var = Variant(activation, w13_bias, w2_bias, alpha, limit, gate_up_interleaved,
                  weights_on_input, w3, same_view(w13, w3))
    T, H = hidden.shape
    E, I = w2.shape[0], w2.shape[2]
    K = topk_ids.shape[1]
    dev = hidden.device
    dt = hidden.dtype
    dx = torch.empty(T, H, dtype=dt, device=dev)
    dweights = torch.zeros(topk_weights.shape, dtype=topk_weights.dtype, device=dev)
    db13 = None if w13_bias is None else torch.empty_like(w13_bias,
                                                          memory_format=torch.contiguous_format)
    db2 = None if w2_bias is None else torch.empty_like(w2_bias,
                                                       memory_format=torch.contiguous_format)
    if T * K == 0 or E == 0:   # no slot reaches an expert: every gradient is zero
        extra = _extra_grads(db13, db2, w3, None if w3 is None else empty_grad(w3))
        return (dx.zero_(), empty_grad(w13).zero_(), empty_grad(w2).zero_(), dweights) + tuple(
            None if b is None else b.zero_() for b in extra)
    cfg = config or dispatch_config(T, E, K, H, I, dev.type, dt)
    bc = bwd_config or backward_config(cfg, dev.type, dt, rows_per_expert=T * K / E,
                                        inter_size=I)
    if z is not None and tuple(z.shape) != (T * K, 2 * I):
        raise ValueError(f"saved z has shape {tuple(z.shape)}, expected {(T * K, 2 * I)}")
    # Every argument of this call's launches is a function of this key and of the buffers each
    # launch names in its launch_key (moe_ops.launch.fast: Triton's per-launch binding skipped).
    key = (cfg, bc, tensor_key(grad_out), tensor_key(hidden), tensor_key(w13), tensor_key(w2),
           tensor_key(topk_weights), tensor_key(topk_ids), z is None or tensor_key(z),
           tuple(t.data_ptr() % 16 for t in (dx, dweights)), var.key(),
           tuple(None if b is None else tensor_key(b) for b in (db13, db2))) \
        if dev.type == "cuda" else None
    al = align_triton(topk_ids, E, cfg.block_m)
    n_slots = T * K
    prec = dot_precision(dt)

    # Buffers are allocated in the order of use and freed after their last one: the weight
    # gradients just before their GEMMs, x gathered (in bc.x_chunks column chunks) only once
    # dO, s*a and dx's per-slot buffer are gone. The peak is the largest of dO gathered + dz +
    # s*a + z + dA (the activation gradient), dW2 + dO gathered + dz + s*a (dW2's GEMM), and
    # dW2 + dW13 + dz + z + x gathered / x_chunks (dW13's), besides dx and the inputs.
    gos = gather_rows_triton(grad_out, al, n_slots, K, key=key and (key, "dO"))
    dz = torch.empty(al.max_rows, 2 * I, dtype=dt, device=dev)
    sa = torch.empty(al.max_rows, I, dtype=dt, device=dev)
    # dA = dO W2_e as a plain grouped GEMM (float32 out, per slot), then one elementwise pass
    # over dA and z.
    if z is None:   # recompute: the forward's gate+up GEMM; z lives only during this call
        z = torch.empty(n_slots, 2 * I, dtype=dt, device=dev)
        gate_up_triton(hidden, w13, sa, al, cfg, n_slots, K, z=z, key=key and (key, "z"),
                       variant=None if w3 is None else Variant(w3=w3, same_w3=var.same_w3))
    dA = torch.empty(n_slots, I, dtype=torch.float32, device=dev)
    rows_gemm_triton(gos, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), dA, al,
                     bc.activation_grad_gemm, n_cols=I, reduce_dim=H, n_slots=n_slots, top_k=K,
                     key=key and (key, "dA"))
    ew = bc.activation_grad
    block_i = min(ew.block_i, next_pow2(I))
    if var.plain:
        fk = launch_key(key and (key, "swiglu"), dA, z, al.sorted_slots, al.num_rows, dz, sa)
        kernel_for(swiglu_grad_kernel, dev, fk)[(cdiv(al.max_rows, ew.rows_per_program),)](
            dA, z, topk_weights, al.sorted_slots, al.num_rows, dz, sa, dweights,
            n_slots, I, K, dA.stride(0), z.stride(0), topk_weights.stride(0),
            topk_weights.stride(1), dz.stride(0), sa.stride(0), dweights.stride(0),
            dweights.stride(1),
            BLOCK_R=ew.rows_per_program, BLOCK_I=block_i, num_warps=4,
        )
    else:
        act_grad_triton(dA, z, topk_weights, al, dz, sa, dweights, gos, var, n_slots, I, H, K,
                        ew.rows_per_program, block_i, key=key)
    del dA, z   # a recomputed z is freed here, before the weight-gradient GEMMs
    if db13 is not None:
        expert_colsum_triton(dz, db13, al, n_slots, K, key=key and (key, "db13"))
    if db2 is not None:
        expert_colsum_triton(gos, db2, al, n_slots, K, key=key and (key, "db2"),
                             weights=None if weights_on_input else topk_weights)

    # dW2_e [H, I] = sum_rows dO[t]^T (s a)[row];  dW13_e [2I, H] = sum_rows dz[row]^T x[t]
    dw2 = empty_grad(w2)
    weight_grad_triton(gos, sa, dw2, al, bc.weight_grad, prec, key=key and (key, "dW2"))
    del gos, sa
    # dx: per-slot dz[row] @ W13_e ([2I] x [2I, H]), then the forward's deterministic combine;
    # before dW13, so that its per-slot buffer is gone by dW13's stage.
    dxs = torch.empty(n_slots, H, dtype=dt, device=dev)
    # (weights_on_input: dx_t = sum_k s dh W13_e, the routing weight in the row GEMM's epilogue)
    # (w3: dz's gate columns against w13, then its up columns against w3, in one sum)
    second = None if w3 is None else (w3, (w3.stride(0), w3.stride(2), w3.stride(1)), I)
    rows_gemm_triton(dz, w13, (w13.stride(0), w13.stride(2), w13.stride(1)), dxs, al,
                     bc.input_grad_gemm, n_cols=H, reduce_dim=2 * I if w3 is None else I,
                     n_slots=n_slots, top_k=K, key=key and (key, "dx"),
                     weights=topk_weights if weights_on_input else None, second=second)
    combine_triton(dxs, topk_ids, dx, E, key=key and (key, "dx"))
    del dxs

    dw13 = empty_grad(w13)
    dw3 = None if w3 is None else empty_grad(w3)
    n_x = x_chunks(bc, H, al.max_rows * H * hidden.element_size(), dz.numel() * dz.element_size())
    width = H // n_x
    for c in range(n_x):
        cols = slice(c * width, (c + 1) * width)
        ck = key and (key, "x", c)
        # (weights_on_input: the experts' input is s x, and dW13_e = dh^T (s x))
        xs = gather_rows_triton(hidden[:, cols], al, n_slots, K, key=ck,
                                weights=topk_weights if weights_on_input else None)
        if w3 is None:
            weight_grad_triton(dz, xs, dw13[:, :, cols], al, bc.weight_grad, prec,
                               key=ck and (ck, "dW13"))
        else:   # dz = [d gate | d up]: the gate half is w13's gradient, the up half w3's
            weight_grad_triton(dz[:, :I], xs, dw13[:, :, cols], al, bc.weight_grad, prec,
                               key=ck and (ck, "dW13"))
            weight_grad_triton(dz[:, I:], xs, dw3[:, :, cols], al, bc.weight_grad, prec,
                               key=ck and (ck, "dW3"))
        del xs
    return (dx, dw13, dw2, dweights) + _extra_grads(db13, db2, w3, dw3)


def _extra_grads(db13, db2, w3, dw3) -> tuple:
    """What follows (dx, dw13, dw2, dweights): (d w13_bias, d w2_bias) where a bias or w3 is
    given (None for an absent bias), then d w3 where w3 is given."""
    if w3 is not None:
        return (db13, db2, dw3)
    return () if db13 is None and db2 is None else (db13, db2)


def act_grad_triton(dA, z, topk_weights, al, dz, sa, dweights, gos, var, n_slots, I, H, top_k,
                    block_r, block_i, key=None):
    """act_grad_kernel (every variant's elementwise backward) over the aligned rows."""
    b13 = var.w13_bias if var.w13_bias is not None else dz
    b2 = var.w2_bias if var.w2_bias is not None else gos
    fk = launch_key(key and (key, "act_grad"), dA, z, al.sorted_slots, al.num_rows,
                    al.block_expert, dz, sa, gos)
    kernel_for(act_grad_kernel, dz.device, fk)[(cdiv(al.max_rows, block_r),)](
        dA, z, topk_weights, al.sorted_slots, al.num_rows, al.block_expert, dz, sa, dweights,
        b13, b2, gos, n_slots, I, H, top_k, dA.stride(0), z.stride(0), topk_weights.stride(0),
        topk_weights.stride(1), dz.stride(0), sa.stride(0), dweights.stride(0),
        dweights.stride(1), b13.stride(0), b13.stride(1), b2.stride(0), b2.stride(1),
        gos.stride(0), float(var.alpha), float(var.limit),
        BLOCK_M=al.block_m, ACT=ACT_CODES[var.activation], HAS_B13=var.w13_bias is not None,
        HAS_B2=var.w2_bias is not None, WEIGHTS_ON_INPUT=var.weights_on_input,
        INTERLEAVED=var.interleaved, BLOCK_R=block_r, BLOCK_I=block_i,
        BLOCK_H=min(256, next_pow2(H)), num_warps=4,
    )


def expert_colsum_triton(src, out, al, n_slots, top_k, key=None, weights=None):
    """out[e] = sum over expert e's valid aligned rows of (weights[slot] *) src[row] (float32,
    rows in order: deterministic): the bias gradients."""
    E, N = out.shape
    block_n = min(128, next_pow2(N))
    tw = weights if weights is not None else src
    fk = launch_key(key, src, out, al.expert_ends, al.sorted_slots)
    kernel_for(expert_colsum_kernel, out.device, fk)[(E, cdiv(N, block_n))](
        src, out, al.expert_ends, al.sorted_slots, tw, n_slots, top_k, N, E,
        src.stride(0), out.stride(0), out.stride(1), tw.stride(0), tw.stride(1),
        SCALED=weights is not None, BLOCK_R=16, BLOCK_N=block_n, num_warps=4,
    )


def gather_rows_triton(src, al, n_slots, top_k, key=None, weights=None):
    """src rows in aligned-row order ([max_rows, H]; padding rows zero, rows past the device-side
    row count left unwritten: no kernel reads them), times the slot's routing weight with
    `weights` ([T, K]). `key`: the fast-launch key of the call (a function of src and the
    alignment's shapes), or None."""
    H = src.shape[1]
    dst = torch.empty(al.max_rows, H, dtype=src.dtype, device=src.device)
    block_r = 16
    fk = launch_key(key, dst, al.sorted_slots, al.num_rows)
    kernel_for(gather_rows_kernel, src.device, fk)[(cdiv(al.max_rows, block_r),)](
        src, al.sorted_slots, al.num_rows, dst, n_slots, top_k, H,
        src.stride(0), src.stride(1), dst.stride(0),
        BLOCK_R=block_r, BLOCK_H=min(512, next_pow2(H)), num_warps=4,
        **({} if weights is None else dict(weights_ptr=weights, stride_tw_t=weights.stride(0),
                                           stride_tw_k=weights.stride(1), SCALED=True)),
    )
    return dst


def weight_grad_triton(left, right, out, al, wg: WeightGradConfig, prec, key=None):
    """out[e] ([M, N]) = sum over expert e's aligned rows of left[row]^T right[row] (up to the
    first step past its valid rows); left and right are contiguous, in aligned-row order, with
    zero padding rows. An `out` that is a transposed view of dense storage (a checkpoint-layout
    weight's gradient) is computed as out^T = right^T left, so that the output tiles are stored
    along its contiguous dimension."""
    if out.stride(2) != 1 and out.stride(1) == 1:
        return weight_grad_triton(right, left, out.transpose(1, 2), al, wg, prec, key=key)
    E, M, N = out.shape
    bk = min(wg.block_k, al.block_m)
    ends = al.expert_ends
    if al.valid_ends.data_ptr() != ends.data_ptr() + E * ends.element_size():
        raise ValueError("weight_grad_triton needs an alignment whose valid ends follow its "
                         "padded ends in one buffer (align_triton's)")
    if al.block_m % bk:
        raise ValueError(f"weight-gradient step {bk} must divide block_m {al.block_m}")
    fk = launch_key(key, left, right, out, al.expert_ends)
    if wg.persistent and _weight_grad_persistent(left, right, out, al, wg, prec, bk, fk):
        return
    kernel_for(weight_grad_kernel, out.device, fk)[
            (E * cdiv(M, wg.block_m) * cdiv(N, wg.block_n),)](
        left, right, out, al.expert_ends, M, N, E,
        left.stride(0), right.stride(0), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=wg.block_m, BLOCK_N=wg.block_n, BLOCK_K=bk, DOT_PRECISION=prec, TRIM=True,
        num_warps=wg.num_warps, num_stages=wg.num_stages,
    )


# The LPT schedule ranks every expert in each program: up to this many experts
LPT_MAX_EXPERTS = 512
# LPT only where the largest expert has more than this many times the mean rows (the kernel
# tests it at run time; the snaking deal costs 3-9% on near-uniform routing)
LPT_MIN_SKEW = 2


def _weight_grad_persistent(left, right, out, al, wg, prec, bk, fk=None) -> bool:
    """weight_grad_triton on the persistent kernel, if it applies: 16-bit operands whose tensor
    descriptors are legal here (weight_desc: 16-byte aligned rows, sm_90+ or the interpreter) and
    output block indices that fit the kernel's packed int32 (< 2^15 row blocks, < 2^16 column
    blocks). Returns whether it ran."""
    if not (1 <= wg.persistent_chunk <= 32 and wg.persistent_chunk & (wg.persistent_chunk - 1) == 0):
        raise ValueError(f"WeightGradConfig.persistent_chunk must be a power of two in [1, 32], "
                         f"got {wg.persistent_chunk}")
    if left.dtype not in (torch.bfloat16, torch.float16):
        return False
    E, M, N = out.shape
    if cdiv(M, wg.block_m) >= 1 << 15 or cdiv(N, wg.block_n) >= 1 << 16:
        return False
    descs = (weight_desc(left, [bk, wg.block_m]), weight_desc(right, [bk, wg.block_n]),
             weight_desc(out, [1, wg.block_m, wg.block_n]))
    if any(d is None for d in descs):
        return False
    n_tiles = E * cdiv(M, wg.block_m) * cdiv(N, wg.block_n)
    programs = min(num_programs(out.device), n_tiles)
    # largest experts' tiles first, dealt in snaking rounds (the kernel's LPT)
    block_e = next_pow2(E)
    lpt = wg.lpt_schedule and E > 1 and block_e <= LPT_MAX_EXPERTS
    order = torch.empty(programs, block_e, dtype=torch.int32, device=out.device) if lpt else None
    fk = fk and fk + (lpt, order is None or order.data_ptr() % 16)
    kernel_for(weight_grad_persistent_kernel, out.device, fk)[(programs,)](
        *descs, al.expert_ends, M, N, E, left.shape[0],
        BLOCK_M=wg.block_m, BLOCK_N=wg.block_n, BLOCK_K=bk, CHUNK=wg.persistent_chunk, SPLIT=1,
        NUM_PROGRAMS=programs, DOT_PRECISION=prec, order_ptr=order, LPT=lpt,
        BLOCK_E=block_e if lpt else 1, LPT_SORT=True, LPT_SNAKE=True,
        LPT_MIN_SKEW=LPT_MIN_SKEW,
        num_warps=wg.num_warps, num_stages=wg.persistent_num_stages or wg.num_stages,
    )
    return True
