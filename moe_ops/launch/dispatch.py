"""Host side of moe.dispatch: align, gate+up GEMM (SwiGLU fused), down GEMM (routing weight
fused), deterministic combine. Every buffer is sized from shapes; nothing syncs with the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ops._runtime import cdiv, next_pow2
from moe_ops.kernels.expert_gemm import (ACT_CODES, combine_kernel, down_combine_one_token_kernel, down_kernel,
                                         gate_up_kernel, zero_dropped_z_kernel)
from moe_ops.launch._common import dot_precision, kernel_for, pdl_args, weight_desc
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.fast import launch_key, optional_tensor_key, tensor_key
from moe_ops.tuning.configs import DispatchConfig, RowGemmConfig
from moe_ops.tuning.heuristics import dispatch_config


def dispatch_triton(hidden, w13, w2, topk_weights, topk_ids, activation="silu", config=None,
                    out=None, save_z=False, *, w13_bias=None, w2_bias=None, alpha=1.702,
                    limit=7.0, gate_up_interleaved=False, weights_on_input=False, w3=None):
    """`out` (internal, for tests that poison outputs) must be a fresh [T, H] buffer.
    save_z (training): also return z = [g | u], the pre-activation per slot ([T*K, 2I], input
    dtype; zero rows for ids < 0 or >= E, as the reference) that dispatch_backward_triton(z=...)
    consumes: the raw product W13_e x in w13's row order, before the bias and the input's
    routing weight. The variant arguments: docs/contract.md (Variant)."""
    var = Variant(activation, w13_bias, w2_bias, alpha, limit, gate_up_interleaved,
                  weights_on_input, w3, same_view(w13, w3))
    T, H = hidden.shape
    E, I = w2.shape[0], w2.shape[2]
    K = topk_ids.shape[1]
    dev = hidden.device
    if out is None:
        out = torch.empty(T, H, dtype=hidden.dtype, device=dev)
    if T == 0:
        return (out, torch.empty(0, 2 * I, dtype=hidden.dtype, device=dev)) if save_z else out
    cfg = config or dispatch_config(T, E, K, H, I, dev.type, hidden.dtype)
    # Every argument of this call's launches is a function of these (moe_ops.launch.fast).
    key = (cfg, save_z, tensor_key(hidden), tensor_key(w13), tensor_key(w2),
           tensor_key(topk_weights), tensor_key(topk_ids), tensor_key(out), var.key()) \
        if dev.type == "cuda" else None
    # Direct rows (no alignment launch; the z of a training forward is per slot either way):
    # slot s is row block s. One token's K slots have K distinct experts, so no weights are read
    # twice; at T > 1 (a few slots, contiguous ids) slots that share an expert read its tiles
    # again, from L2 when those programs run together (DirectRows).
    n_slots = T * K
    if cfg.direct_rows and (T == 1 or (n_slots <= DIRECT_MAX_SLOTS and topk_ids.is_contiguous())):
        al = DirectRows(topk_ids if T == 1 else topk_ids.view(1, n_slots), cfg.block_m)
    else:
        al = align_triton(topk_ids, E, cfg.block_m, pdl=cfg.dependent_launch)
    act = torch.empty(al.max_rows, I, dtype=hidden.dtype, device=dev)
    z = torch.empty(T * K, 2 * I, dtype=hidden.dtype, device=dev) if save_z else None
    direct = isinstance(al, DirectRows)
    group_m = _group_m(cfg, al)
    if direct and T == 1 and cfg.down_combine_fused and K <= cfg.block_m:
        gate_up_triton(hidden, w13, act, al, cfg, n_slots, K, z=z, pdl=cfg.dependent_launch,
                       key=key, variant=var, topk_weights=topk_weights)
        down_combine_one_token_triton(act, w2, topk_weights, topk_ids, out, cfg, key=key,
                                      variant=var)
        if save_z:
            zero_dropped_z_triton(z, topk_ids, E, key=key)
        return (out, z) if save_z else out
    # One token, combine_last: the down kernel's last program per H tile does the combine, with
    # counters that this call's gate_up kernel zeroes (no combine launch).
    counters = None
    if direct and T == 1 and cfg.combine_in_down and K <= 32:
        counters = torch.empty(cdiv(H, cfg.down_block_n), dtype=torch.int32, device=dev)
    gate_up_triton(hidden, w13, act, al, cfg, n_slots, K, z=z, pdl=cfg.dependent_launch,
                   counters=counters, key=key, variant=var, topk_weights=topk_weights)
    # Per-slot expert outputs (bias and routing weight applied, rounded once to the input dtype,
    # as vLLM does; float32 for float32 inputs); the combine sums them in float32 in a fixed
    # order.
    y = torch.empty(n_slots, H, dtype=hidden.dtype, device=dev)
    down = RowGemmConfig(block_n=cfg.down_block_n, block_k=cfg.down_block_k,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         tma_activations=cfg.tma_down_activations)
    rows_gemm_triton(act, w2, (w2.stride(0), w2.stride(1), w2.stride(2)), y, al, down,
                     n_cols=H, reduce_dim=I, n_slots=n_slots, top_k=K, group_m=group_m,
                     weights=None if weights_on_input else topk_weights,
                     tma_weights=cfg.tma_weights, pdl=cfg.dependent_launch,
                     half_height_tails=cfg.half_height_tails,
                     combine=None if counters is None else (counters, out, topk_ids), key=key,
                     bias=w2_bias)
    if counters is None:
        combine_triton(y, topk_ids, out, E, pdl=cfg.dependent_launch, key=key)
    if save_z:
        zero_dropped_z_triton(z, topk_ids, E, key=key)
    return (out, z) if save_z else out


def zero_dropped_z_triton(z, topk_ids, num_experts, key=None):
    """z rows of the slots without an expert (ids < 0 or >= E) set to zero: one small launch
    that reads the [T, K] ids and writes only those rows (moe.dispatch_train's z is then a
    function of its inputs: bitwise reproducible, and equal to the reference's zeros there)."""
    K = topk_ids.shape[1]
    n_slots, n_cols = z.shape
    block_r = 16
    fk = launch_key(key and (key, "zero_z"), z)
    kernel_for(zero_dropped_z_kernel, z.device, fk)[(cdiv(n_slots, block_r),)](
        z, topk_ids, n_slots, n_cols, num_experts, z.stride(0),
        topk_ids.stride(0), topk_ids.stride(1),
        TOP_K=K, BLOCK_R=block_r, BLOCK_C=min(512, next_pow2(n_cols)), num_warps=4,
    )


@dataclass(frozen=True)
class Variant:
    """moe.dispatch's variant arguments as the launchers take them (docs/contract.md)."""
    activation: str = "silu"
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    alpha: float = 1.702
    limit: float = 7.0
    interleaved: bool = False
    weights_on_input: bool = False
    w3: torch.Tensor | None = None   # the up projection apart from the gate (w13 [E, I, H])
    same_w3: bool = False   # w3 is the same view as w13 (ungated ReLU-squared experts)

    @property
    def plain(self) -> bool:
        """SwiGLU on gate-first rows, no bias, weights on the output (Mixtral's experts). (w3
        changes only where the GEMMs read the up rows, not this.)"""
        return (self.activation == "silu" and self.w13_bias is None and self.w2_bias is None
                and not self.interleaved and not self.weights_on_input)

    def key(self):
        """What the launches' arguments depend on (fast launch keys)."""
        return (self.activation, float(self.alpha), float(self.limit), self.interleaved,
                self.weights_on_input, optional_tensor_key(self.w13_bias),
                optional_tensor_key(self.w2_bias), optional_tensor_key(self.w3), self.same_w3)

    def gate_up_args(self, topk_weights) -> dict:
        """gate_up_kernel's variant arguments (none for the default SwiGLU on gate-first rows:
        the kernel's defaults, the same compiled kernel as before the variants)."""
        kw = {}
        if self.activation != "silu":
            kw.update(ACT=ACT_CODES[self.activation], alpha=float(self.alpha),
                      limit=float(self.limit))
        if self.interleaved:
            kw.update(INTERLEAVED=True)
        b = self.w13_bias
        if b is not None:
            kw.update(b_ptr=b, stride_be=b.stride(0), stride_bn=b.stride(1), HAS_BIAS=True)
        if self.weights_on_input:
            kw.update(tw_ptr=topk_weights, stride_tw_t=topk_weights.stride(0),
                      stride_tw_k=topk_weights.stride(1), WEIGHTS_ON_INPUT=True)
        if self.w3 is not None:
            kw.update(w3_args(self.w3))
            if self.same_w3:
                kw.update(SAME_W3=True)
        return kw


def same_view(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """b reads exactly the elements of a, in the same order (w3 passed as w13: one tile and one
    product per step in the gate+up GEMM)."""
    return (b is not None and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def w3_args(w3) -> dict:
    """gate_up_kernel's arguments for an up projection apart from the gate (pointer path)."""
    return dict(w3_ptr=w3, stride_w3e=w3.stride(0), stride_w3n=w3.stride(1),
                stride_w3k=w3.stride(2), HAS_W3=True)


def _bias_args(b) -> dict:
    """The down kernels' bias arguments (w2_bias [E, N]); none without a bias."""
    if b is None:
        return {}
    return dict(b_ptr=b, stride_be=b.stride(0), stride_bn=b.stride(1), HAS_BIAS=True)


_PLAIN = Variant()


def gate_up_triton(hidden, w13, act, al, cfg: DispatchConfig, n_slots, top_k, *, z=None,
                   pdl=False, counters=None, key=None, variant=None, topk_weights=None):
    """act[row] = SwiGLU(W13_e x_t) over the aligned rows (gathering token rows through the slot
    table); with `z` ([T*K, 2I]) also the pre-activation per slot. `counters` (int32): zeroed
    for the down kernel's combine_in_down (after the PDL wait: the buffer may be memory that the
    kernel before was still using). `key`: dispatch_triton's launch key (fast launch), or None.
    `variant` (Variant; None: the default) with `topk_weights` (read with weights_on_input):
    bias, activation, interleaved rows, a separate up projection (w3: the gate rows come from
    w13 and the up rows from w3, both by pointer loads; no descriptor path takes w3). z is the
    raw product W13_e x in w13's row order whatever the variant (with w3: [gate | up])."""
    H = hidden.shape[1]
    I = act.shape[1]
    n_blocks = al.max_rows // cfg.block_m
    zz = act if z is None else z
    var = variant or _PLAIN
    bn, bk = cfg.gate_up_block_n, cfg.gate_up_block_k
    w_desc, pair, trans = None, False, False
    st = w13.stride()
    # w3 (gate and up rows in two tensors): the pointer path, whatever the config asks (the
    # descriptor paths read gate and up tiles from one tensor; docs/design.md)
    tma = cfg.tma_weights and var.w3 is None
    if tma and st[2] != 1 and st[1] == 1 and 2 * bn <= 256:
        # a transposed view of [E, H, 2I] storage (gpt-oss's checkpoint layout): descriptors
        # over the storage (a copy's box is at most 256 wide)
        E = w13.shape[0]
        if var.interleaved:
            w_desc = weight_desc(w13, [1, bk, 2 * bn], shape=[E, H, 2 * I],
                                 strides=[st[0], st[2], 1])
        else:
            w_desc = weight_desc(w13, [1, bk, 2, bn], shape=[E, H, 2, I],
                                 strides=[st[0], st[2], I, 1])
        trans = w_desc is not None
    elif tma and cfg.tma_gate_up_pair:   # [E, 2I, H] as [E, 2, I, H]: one copy
        # gate-first rows: (e, j, i) is row j*I + i; interleaved: row 2i + j
        mid = [st[1], 2 * st[1]] if var.interleaved else [I * st[1], st[1]]
        w_desc = weight_desc(w13, [1, 2, bn, bk],
                             shape=[w13.shape[0], 2, I, H], strides=[st[0], *mid, st[2]])
        pair = w_desc is not None
    if tma and w_desc is None and not var.interleaved:
        # (the two-copy path reads the up tile at row I + n: gate-first rows only)
        w_desc = weight_desc(w13, [1, bn, bk])
    direct = _direct_args(al, w13.shape[0])
    cnt = {} if counters is None else dict(counters_ptr=counters, n_counters=counters.numel(),
                                           BLOCK_C=next_pow2(counters.numel()))
    fk = launch_key(key and (key, "gate_up"), act, al.sorted_slots, al.block_expert, al.num_rows,
                    z, counters)
    kernel_for(gate_up_kernel, hidden.device, fk)[(n_blocks * cdiv(I, bn),)](
        hidden, w13, act, al.sorted_slots, al.block_expert, al.num_rows,
        n_slots, H, I, top_k,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), n_blocks, I, zz, zz.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=_group_m(cfg, al),
        DOT_PRECISION=dot_precision(hidden.dtype), SAVE_Z=z is not None,
        w_desc=w_desc, USE_TMA=w_desc is not None, TMA_PAIR=pair, **direct,
        HALF_TAIL=_half_tail(cfg.half_height_tails, al), **cnt,
        **var.gate_up_args(topk_weights), **({"TMA_TRANS": True} if trans else {}),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(pdl, hidden.device),
    )


def rows_gemm_triton(a, w, w_strides, y, al, config: RowGemmConfig, *, n_cols, reduce_dim, n_slots,
                     top_k, group_m=8, weights=None, tma_weights=False, half_height_tails=False,
                     pdl=False, combine=None, key=None, bias=None, second=None):
    """y[slot] = (weights[slot] *) a[row] @ W_e^T ([n_cols]) for the aligned rows: `a` is
    contiguous in aligned-row order ([max_rows, reduce_dim]); W_e[n, k] = w[e*w_strides[0] +
    n*w_strides[1] + k*w_strides[2]] (any layout); y is per slot ([T*K, n_cols], rows of ids < 0
    unwritten). The forward's down GEMM, and in the backward dA = dO W2_e and dx = dz W13_e.
    With `tma_weights`, W_e's tiles come through a tensor descriptor of `w` when its layout
    allows one ([E, N, K] or [E, K, N] storage with 16-byte aligned rows); with
    config.tma_activations, so do the A tiles (`a` with 16-byte aligned rows; a_tile_descs).
    `half_height_tails`: tail row blocks with at most block_m/2 valid rows run a half-height
    tile. `combine` = (counters, out, topk_ids), direct rows only: the last program per column
    tile also sums the K rows into out ([1, n_cols]). `bias` ([E, n_cols], optional): added to
    each row before the weight (the forward's w2_bias). `second` = (w3, w3_strides, k3): after
    the reduce_dim columns of `a` against W_e, a's next k3 columns are multiplied by W3_e
    (addressed as W_e by w3_strides) into the same sums (the backward's dx with a separate up
    projection); pointer loads for both parts then."""
    N, K_red = n_cols, reduce_dim
    block_n, block_k = config.block_n, config.block_k
    bm = al.block_m
    n_blocks = al.max_rows // bm
    tw = weights if weights is not None else y
    w_desc, layout = None, 0
    if w.stride(2) != 1 and w.stride(1) == 1:
        # a transposed view (a checkpoint's [E, K, N] or [E, N, K] storage seen the other way):
        # descriptors over the storage's own order
        w = w.transpose(1, 2)
    if tma_weights and tuple(w_strides) == tuple(w.stride()):       # storage [E, N, K]
        w_desc, layout = weight_desc(w, [1, block_n, block_k]), 1
    elif tma_weights and tuple(w_strides) == (w.stride(0), w.stride(2), w.stride(1)):   # [E, K, N]
        w_desc, layout = weight_desc(w, [1, block_k, block_n]), 2
    if w_desc is None or second is not None:
        w_desc, layout = None, 0
    half = _half_tail(half_height_tails, al)
    a_descs = (a_tile_descs(a, bm, block_k, half)
               if config.tma_activations and second is None else None)
    w3kw = {}
    if second is not None:
        w3, st3, k3 = second
        w3kw = dict(w3_ptr=w3, stride_w3e=st3[0], stride_w3n=st3[1], stride_w3k=st3[2], K3=k3,
                    A3_OFF=K_red, HAS_W3=True)
    direct = _direct_args(al, w.shape[0])
    comb = {}
    if combine is not None:
        if not direct:
            raise ValueError("the folded combine needs direct rows (T == 1)")
        counters, out, ids = combine
        comb = dict(counters_ptr=counters, out_ptr=out, stride_oh=out.stride(1),
                    COMBINE_K=ids.shape[1], FENCE=a.device.type == "cuda")   # inline PTX compiled only
    fk = launch_key(key and (key, "down"), a, y, al.sorted_slots, al.block_expert, al.num_rows,
                    comb.get("counters_ptr"))
    kernel_for(down_kernel, a.device, fk)[(n_blocks * cdiv(N, block_n),)](
        a, w, y, tw, al.sorted_slots, al.block_expert, al.num_rows,
        n_slots, N, K_red, top_k,
        a.stride(0), w_strides[0], w_strides[1], w_strides[2],
        tw.stride(0), tw.stride(1), y.stride(0), n_blocks, N,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION=dot_precision(a.dtype), HAS_WEIGHTS=weights is not None,
        w_desc=w_desc, TMA_LAYOUT=layout, **direct, HALF_TAIL=half,
        **comb, **({} if a_descs is None else dict(a_desc=a_descs[0], a_desc_half=a_descs[1],
                                                    A_TMA=True)), **_bias_args(bias), **w3kw,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(pdl, a.device),
    )


def a_tile_descs(a, block_m, block_k, half):
    """Descriptors of the row GEMM's A operand (`a` [rows, K] in aligned-row order), blocks
    [block_m, block_k] and, for half-height tails, [block_m // 2, block_k] (else None); None
    where the layout allows no descriptor (weight_desc)."""
    full = weight_desc(a, [block_m, block_k])
    if full is None:
        return None
    return full, weight_desc(a, [block_m // 2, block_k]) if half else None


def combine_triton(y, topk_ids, out, num_experts, pdl=False, key=None):
    """out[t] = sum over k in order of the per-slot rows y[t*K + k] of valid ids (float32 sum,
    deterministic). Small T: narrow column blocks, so that more programs share the latency."""
    T, H = out.shape
    K = topk_ids.shape[1]
    block_t = 4
    block_h = min(1024 if T > 64 else 256, next_pow2(H))
    fk = launch_key(key and (key, "combine"), y)
    kernel_for(combine_kernel, out.device, fk)[(cdiv(T, block_t), cdiv(H, block_h))](
        y, topk_ids, out, T, H, num_experts,
        topk_ids.stride(0), topk_ids.stride(1), y.stride(0), out.stride(0), out.stride(1),
        TOP_K=K, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, **pdl_args(pdl, out.device),
    )


def down_combine_one_token_triton(act, w2, topk_weights, topk_ids, out, cfg, key=None,
                                  variant=None):
    """T == 1 with direct rows: out = sum over k of w_k * act[k*block_m] @ W2_{e_k}^T in one
    launch (the down GEMM with the combine folded in); down_block_n columns of H per program."""
    E, H, I = w2.shape
    K = topk_ids.shape[1]
    var = variant or _PLAIN
    w_desc = weight_desc(w2, [1, cfg.down_block_n, cfg.down_block_k]) if cfg.tma_weights else None
    extra = _bias_args(var.w2_bias)
    if var.weights_on_input:
        extra.update(WEIGHTS_ON_INPUT=True)
    fk = launch_key(key and (key, "down_combine"), act)
    kernel_for(down_combine_one_token_kernel, act.device, fk)[(cdiv(H, cfg.down_block_n),)](
        act, w2, topk_weights, topk_ids, out, H, I, E,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), topk_weights.stride(1),
        topk_ids.stride(1), out.stride(1),
        TOP_K=K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        DOT_PRECISION=dot_precision(act.dtype), w_desc=w_desc, USE_TMA=w_desc is not None,
        **extra, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(cfg.dependent_launch, act.device),
    )


@dataclass
class DirectRows:
    """The rows of a call without an alignment: row block s is slot s alone (expert
    ids[0, s]). At T == 1 the K slots have K distinct experts, so no weights are read twice; at
    T > 1 (at most DIRECT_MAX_SLOTS slots) slots may share an expert, and the kernels walk the
    column tiles with every slot together (_group_m), so the programs that read one expert's
    tile run at about the same time and all but the first find it in L2. The kernels take it in
    place of an Alignment (DIRECT=True); its table fields are unused placeholders."""
    ids: torch.Tensor   # topk_ids [1, K] (any strides), or a [1, T*K] view of contiguous ids
    block_m: int

    @property
    def max_rows(self) -> int:
        return self.ids.shape[1] * self.block_m

    @property
    def sorted_slots(self):
        return self.ids

    block_expert = num_rows = sorted_slots


# Direct rows at T > 1 only up to this many slots (the grouping below makes the slot count a
# compile-time constant, rounded up to a power of two).
DIRECT_MAX_SLOTS = 256


def _group_m(cfg, al) -> int:
    """GROUP_M of the GEMM grids: with direct rows every row block (slot) walks the column
    tiles together (the blocks of one expert share its weight tiles through L2); else the
    config's."""
    if isinstance(al, DirectRows):
        return max(cfg.group_m, next_pow2(al.ids.shape[1]))
    return cfg.group_m


def _half_tail(enabled: bool, al) -> bool:
    """Half-height tiles for tail row blocks: aligned rows only, and blocks of >= 32 rows."""
    return bool(enabled) and not isinstance(al, DirectRows) and al.block_m >= 32


def _direct_args(al, n_experts) -> dict:
    if not isinstance(al, DirectRows):
        return {}
    return dict(ids_ptr=al.ids, stride_ik=al.ids.stride(1), n_experts=n_experts, DIRECT=True)
