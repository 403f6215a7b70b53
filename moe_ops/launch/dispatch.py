"""Host side of moe.dispatch: align, gate+up GEMM (SwiGLU fused), down GEMM (routing weight
fused), deterministic combine. Every buffer is sized from shapes; nothing syncs with the host."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from moe_ops._runtime import cdiv, ensure_triton_allocator, kernel_for, next_pow2
from moe_ops.kernels.expert_gemm import (combine_kernel, down_combine_one_token_kernel, down_kernel,
                                         gate_up_kernel, rows_gemm_ws_kernel, zero_dropped_z_kernel)
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.fast import launch_key, tensor_key
from moe_ops.tuning.heuristics import dispatch_config


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get full-precision products (tf32 would cost ~3e-4 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


def dispatch_triton(hidden, w13, w2, topk_weights, topk_ids, activation="silu", config=None,
                    out=None, save_z=False, *, w13_bias=None, w2_bias=None, alpha=1.702,
                    limit=7.0, gate_up_interleaved=False, weights_on_input=False):
    """`out` (internal, for tests that poison outputs) must be a fresh [T, H] buffer.
    save_z (training): also return z = [g | u], the pre-activation per slot ([T*K, 2I], input
    dtype; zero rows for ids < 0 or >= E, as the reference) that dispatch_backward_triton(z=...)
    consumes."""
    if (activation != "silu" or w13_bias is not None or w2_bias is not None
            or gate_up_interleaved or weights_on_input):
        raise NotImplementedError("moe.dispatch variants in the Triton kernels")
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
           tensor_key(topk_weights), tensor_key(topk_ids), tensor_key(out)) \
        if dev.type == "cuda" else None
    # Direct rows (no alignment launch; the z of a training forward is per slot either way):
    # slot s is row block s. One token's K slots have K distinct experts, so no weights are read
    # twice; at T > 1 (a few slots, contiguous ids) slots that share an expert read its tiles
    # again, from L2 when those programs run together (DirectRows).
    n_slots = T * K
    if cfg.direct and (T == 1 or (n_slots <= DIRECT_MAX_SLOTS and topk_ids.is_contiguous())):
        al = DirectRows(topk_ids if T == 1 else topk_ids.view(1, n_slots), cfg.block_m)
    else:
        al = align_triton(topk_ids, E, cfg.block_m, pdl=cfg.pdl)
    act = torch.empty(al.max_rows, I, dtype=hidden.dtype, device=dev)
    z = torch.empty(T * K, 2 * I, dtype=hidden.dtype, device=dev) if save_z else None
    direct = isinstance(al, DirectRows)
    group_m = _group_m(cfg, al)
    if direct and T == 1 and cfg.fuse_combine and K <= cfg.block_m:
        gate_up_triton(hidden, w13, act, al, cfg, n_slots, K, z=z, pdl=cfg.pdl, key=key)
        down_combine_one_token_triton(act, w2, topk_weights, topk_ids, out, cfg, key=key)
        if save_z:
            zero_dropped_z_triton(z, topk_ids, E, key=key)
        return (out, z) if save_z else out
    # One token, combine_last: the down kernel's last program per H tile does the combine, with
    # counters that this call's gate_up kernel zeroes (no combine launch).
    counters = None
    if direct and T == 1 and cfg.combine_last and K <= 32:
        counters = torch.empty(cdiv(H, cfg.block_n2), dtype=torch.int32, device=dev)
    gate_up_triton(hidden, w13, act, al, cfg, n_slots, K, z=z, pdl=cfg.pdl, counters=counters,
                   key=key)
    # Per-slot expert outputs (routing weight applied, rounded once to the input dtype, as vLLM
    # does; float32 for float32 inputs); the combine sums them in float32 in a fixed order.
    y = torch.empty(n_slots, H, dtype=hidden.dtype, device=dev)
    rows_gemm_triton(act, w2, (w2.stride(0), w2.stride(1), w2.stride(2)), y, al, H, I, n_slots, K,
                     cfg.block_n2, cfg.block_k2, cfg.num_warps, cfg.num_stages, group_m,
                     weights=topk_weights, tma=cfg.tma, tma_a=cfg.tma_a, pdl=cfg.pdl,
                     half_tail=cfg.half_tail,
                     combine=None if counters is None else (counters, out, topk_ids), key=key,
                     ws=cfg.down_ws)
    if counters is None:
        combine_triton(y, topk_ids, out, E, pdl=cfg.pdl, key=key)
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


def gate_up_triton(hidden, w13, act, al, cfg, n_slots, top_k, z=None, pdl=False, counters=None,
                   key=None):
    """act[row] = SwiGLU(W13_e x_t) over the aligned rows (gathering token rows through the slot
    table); with `z` ([T*K, 2I]) also the pre-activation per slot. `counters` (int32): zeroed
    for the down kernel's combine_last (after the PDL wait: the buffer may be memory that the
    kernel before was still using). `key`: dispatch_triton's launch key (fast launch), or None."""
    H = hidden.shape[1]
    I = act.shape[1]
    n_blocks = al.max_rows // cfg.block_m
    zz = act if z is None else z
    w_desc, pair = None, False
    if cfg.tma and cfg.tma_pair:   # [E, 2I, H] seen as [E, 2, I, H]: gate and up in one copy
        st = w13.stride()
        w_desc = weight_desc(w13, [1, 2, cfg.block_n1, cfg.block_k1],
                             shape=[w13.shape[0], 2, I, H], strides=[st[0], I * st[1], st[1], st[2]])
        pair = w_desc is not None
    if cfg.tma and w_desc is None:
        w_desc = weight_desc(w13, [1, cfg.block_n1, cfg.block_k1])
    direct = _direct_args(al, w13.shape[0])
    cnt = {} if counters is None else dict(counters_ptr=counters, n_counters=counters.numel(),
                                           BLOCK_C=next_pow2(counters.numel()))
    fk = launch_key(key and (key, "gate_up"), act, al.sorted_slots, al.block_expert, al.num_rows,
                    z, counters)
    kernel_for(gate_up_kernel, hidden.device, fk)[(n_blocks * cdiv(I, cfg.block_n1),)](
        hidden, w13, act, al.sorted_slots, al.block_expert, al.num_rows,
        n_slots, H, I, top_k,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), n_blocks, I, zz, zz.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1,
        GROUP_M=_group_m(cfg, al),
        DOT_PRECISION=_dot_precision(hidden.dtype), SAVE_Z=z is not None,
        w_desc=w_desc, USE_TMA=w_desc is not None, TMA_PAIR=pair, **direct,
        HALF_TAIL=_half_tail(cfg.half_tail, al), **cnt,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_args(pdl, hidden.device),
    )


def rows_gemm_triton(a, w, w_strides, y, al, N, K_red, n_slots, top_k, block_n, block_k,
                     num_warps, num_stages, group_m=8, weights=None, tma=False, tma_a=False,
                     pdl=False, half_tail=False, combine=None, key=None, ws=False):
    """y[slot] = (weights[slot] *) a[row] @ W_e^T ([N]) for the aligned rows: `a` is contiguous in
    aligned-row order ([max_rows, K_red]); W_e[n, k] = w[e*w_strides[0] + n*w_strides[1] +
    k*w_strides[2]] (any layout); y is per slot ([T*K, N], rows of ids < 0 unwritten). The
    forward's down GEMM, and in the backward dA = dO W2_e and dx = dz W13_e. With `tma`, W_e's
    tiles come through a tensor descriptor of `w` when its layout allows one ([E, N, K] or
    [E, K, N] storage with 16-byte aligned rows); with `tma_a`, so do the A tiles (`a` with
    16-byte aligned rows; a_tile_descs). `half_tail`: tail row blocks with at most
    block_m/2 valid rows run a half-height tile. `combine` = (counters, out, topk_ids), direct
    rows only: the last program per N tile also sums the K rows into out ([1, N]). `ws`: the
    persistent warp-specialised kernel where it applies (_rows_gemm_ws; `pdl`, `half_tail` and
    `num_warps` do not apply to it)."""
    if ws and combine is None and _rows_gemm_ws(a, w, w_strides, y, al, N, K_red, n_slots, top_k,
                                                 block_n, block_k, num_stages, group_m, weights):
        return
    bm = al.block_m
    n_blocks = al.max_rows // bm
    tw = weights if weights is not None else y
    w_desc, layout = None, 0
    if tma and tuple(w_strides) == tuple(w.stride()):       # storage [E, N, K]
        w_desc, layout = weight_desc(w, [1, block_n, block_k]), 1
    elif tma and tuple(w_strides) == (w.stride(0), w.stride(2), w.stride(1)):   # [E, K, N]
        w_desc, layout = weight_desc(w, [1, block_k, block_n]), 2
    if w_desc is None:
        layout = 0
    half = _half_tail(half_tail, al)
    a_descs = a_tile_descs(a, bm, block_k, half) if tma_a else None
    direct = _direct_args(al, w.shape[0])
    comb = {}
    if combine is not None:
        if not direct:
            raise ValueError("the folded combine needs direct rows (T == 1)")
        counters, out, ids = combine
        comb = dict(counters_ptr=counters, out_ptr=out, stride_oh=out.stride(1),
                    COMBINE_K=ids.shape[1], FENCE=_compiled_code(a.device))
    fk = launch_key(key and (key, "down"), a, y, al.sorted_slots, al.block_expert, al.num_rows,
                    comb.get("counters_ptr"))
    kernel_for(down_kernel, a.device, fk)[(n_blocks * cdiv(N, block_n),)](
        a, w, y, tw, al.sorted_slots, al.block_expert, al.num_rows,
        n_slots, N, K_red, top_k,
        a.stride(0), w_strides[0], w_strides[1], w_strides[2],
        tw.stride(0), tw.stride(1), y.stride(0), n_blocks, N,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION=_dot_precision(a.dtype), HAS_WEIGHTS=weights is not None,
        w_desc=w_desc, TMA_LAYOUT=layout, **direct, HALF_TAIL=half,
        **comb, **({} if a_descs is None else dict(a_desc=a_descs[0], a_desc_half=a_descs[1],
                                                    A_TMA=True)),
        num_warps=num_warps, num_stages=num_stages, **_pdl_args(pdl, a.device),
    )


def a_tile_descs(a, block_m, block_k, half):
    """Descriptors of the row GEMM's A operand (`a` [rows, K] in aligned-row order), blocks
    [block_m, block_k] and, for half-height tails, [block_m // 2, block_k] (else None); None
    where the layout allows no descriptor (weight_desc)."""
    full = weight_desc(a, [block_m, block_k])
    if full is None:
        return None
    return full, weight_desc(a, [block_m // 2, block_k]) if half else None


def _rows_gemm_ws(a, w, w_strides, y, al, N, K_red, n_slots, top_k, block_n, block_k,
                  num_stages, group_m, weights) -> bool:
    """rows_gemm_triton on rows_gemm_ws_kernel, if it applies: aligned rows of 64- or 128-row
    blocks (two consumer warp groups split a tile: fewer rows give no wgmma), 16-bit operands,
    `a` and W in one of the kernel's two storage layouts with 16-byte aligned rows, K_red a
    multiple of block_k, a GPU with tensor memory access (sm_90+) or the interpreter. At most 4 pipeline stages: at 5 (128x128x64
    tiles) Triton 3.6 compiles a kernel that leaves whole output tiles unwritten (measured on
    the H200, benchmarks/NOTES.md entry 24). A config this Triton fails to compile (shared
    memory, or its warp-specialisation pass) is declined (launch_ws). Returns whether it
    ran."""
    E = w.shape[0]
    if (isinstance(al, DirectRows) or al.block_m not in (64, 128) or num_stages > 4
            or a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype
            or K_red % block_k):
        return False
    if not (tma_layout_ok(a) and tma_layout_ok(w)):
        return False
    es = a.element_size()
    if tuple(w_strides) == (N * K_red, K_red, 1) and w.is_contiguous():
        layout = 1      # [E, N, K_red] storage
    elif tuple(w_strides) == (N * K_red, 1, N) and w.is_contiguous():
        layout = 2      # [E, K_red, N] storage
    else:
        return False
    if N * es % 16 or K_red * es % 16:
        return False
    # Shared memory as compiled for sm_90: the stages' A and W tiles, the epilogue's staging
    # (128 x block_n x 4 bytes for a float32 output, x 1 byte for a 16-bit one) and ~2 KB of
    # barriers (e.g. 229928 bytes for 256-wide bf16 tiles with 4 stages; 278528 for 256-wide
    # float32 ones with 3: over the limit). A config the compiler still rejects falls back too.
    bm = al.block_m
    smem = (num_stages * (bm + block_n) * block_k * es
            + bm * block_n * (4 if y.element_size() == 4 else 1) + 2048)
    if smem > SMEM_LIMIT:
        return False
    n_tiles = (al.max_rows // bm) * cdiv(N, block_n)
    programs = max(1, min(num_programs(a.device), n_tiles))
    tw = weights if weights is not None else y
    key = (bm, block_n, block_k, num_stages, a.dtype, y.dtype, weights is not None, layout)
    return launch_ws(
        rows_gemm_ws_kernel, a.device, (programs,), key,
        a, w, y, tw, al.sorted_slots, al.block_expert, al.num_rows,
        n_slots, N, K_red, top_k, a.shape[0], E,
        a.stride(0), tw.stride(0), tw.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        NUM_PROGRAMS=programs, W_LAYOUT=layout, HAS_WEIGHTS=weights is not None,
        DOT_PRECISION=_dot_precision(a.dtype), num_warps=4, num_stages=num_stages,
    )


def launch_ws(kernel, device, grid, key, *args, **kwargs) -> bool:
    """Launch a warp-specialised kernel (their tensor descriptors are made on the device, so
    Triton's scratch allocator is set first). Returns False, with nothing launched, when this
    Triton fails to compile it (raised before any launch: shared memory over the limit, a
    compilation error, or its MLIR pass pipeline failing: Triton's Hopper warp specialisation
    rejects some loops, e.g. Triton 3.6 with a split epilogue), so that the caller runs its
    per-tile kernel; a warning says so once, and `key` (what the compile depends on besides the
    kernel) is not tried again. Any other error propagates."""
    if (kernel, key) in _WS_REJECTED:
        return False
    if device.type == "cuda":
        ensure_triton_allocator()
    try:
        kernel_for(kernel, device)[grid](*args, **kwargs)
    except Exception as exc:
        if not (isinstance(exc, (OutOfResources, CompilationError))
                or (isinstance(exc, RuntimeError) and "PassManager::run failed" in str(exc))):
            raise
        _WS_REJECTED.add((kernel, key))
        last = str(exc).splitlines()[-1][:200] if str(exc) else ""
        warnings.warn(f"moe_ops: {kernel.fn.__name__} did not compile here "
                      f"({type(exc).__name__}: {last}); the per-tile kernel runs instead",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


SMEM_LIMIT = 232448   # bytes of shared memory a program may use on sm_90
_WS_REJECTED: set = set()   # (kernel, key) of warp-specialised launches the compiler rejected


@functools.lru_cache(maxsize=None)
def num_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM on CUDA, three in the interpreter (several
    tiles each)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


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
        TOP_K=K, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, **_pdl_args(pdl, out.device),
    )


def down_combine_one_token_triton(act, w2, topk_weights, topk_ids, out, cfg, key=None):
    """T == 1 with direct rows: out = sum over k of w_k * act[k*block_m] @ W2_{e_k}^T in one
    launch (the down GEMM with the combine folded in); block_n2 columns of H per program."""
    E, H, I = w2.shape
    K = topk_ids.shape[1]
    w_desc = weight_desc(w2, [1, cfg.block_n2, cfg.block_k2]) if cfg.tma else None
    fk = launch_key(key and (key, "down_combine"), act)
    kernel_for(down_combine_one_token_kernel, act.device, fk)[(cdiv(H, cfg.block_n2),)](
        act, w2, topk_weights, topk_ids, out, H, I, E,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), topk_weights.stride(1),
        topk_ids.stride(1), out.stride(1),
        TOP_K=K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2,
        DOT_PRECISION=_dot_precision(act.dtype), w_desc=w_desc, USE_TMA=w_desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_args(cfg.pdl, act.device),
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


def _pdl_args(pdl: bool, device: torch.device) -> dict:
    """Launch options of a kernel with programmatic dependent launch (Hopper and later; off in the
    interpreter, which cannot run the grid-dependency instructions)."""
    if not pdl or device.type != "cuda" or not _sm90(device):
        return {}
    return dict(USE_PDL=True, launch_pdl=True)


def _compiled_code(device: torch.device) -> bool:
    """Whether kernels launched for `device` are compiled (CUDA), not interpreted: inline PTX
    only there."""
    return device.type == "cuda"


def _half_tail(enabled: bool, al) -> bool:
    """Half-height tiles for tail row blocks: aligned rows only, and blocks of >= 32 rows."""
    return bool(enabled) and not isinstance(al, DirectRows) and al.block_m >= 32


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _direct_args(al, n_experts) -> dict:
    if not isinstance(al, DirectRows):
        return {}
    return dict(ids_ptr=al.ids, stride_ik=al.ids.stride(1), n_experts=n_experts, DIRECT=True)


def tma_layout_ok(t, strides=None) -> bool:
    """Whether tensor memory access can address `t` (or the view of its storage with
    `strides`): a GPU with a tensor memory accelerator (sm_90+; the interpreter too), a
    contiguous last dimension, a 16-byte aligned base and 16-byte multiples as other strides,
    none of them 0 (an expanded tensor, e.g. one expert's weights broadcast over E: the pointer
    path reads it as it is). The host descriptors (weight_desc) and the kernels that make
    theirs on the device (the warp-specialised ones) share it."""
    if t.is_cuda and not _sm90(t.device):
        return False
    strides = t.stride() if strides is None else strides
    es = t.element_size()
    return (strides[-1] == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and st * es % 16 == 0 for st in strides[:-1]))


def weight_desc(w, block_shape, shape=None, strides=None):
    """A tensor-memory-access descriptor of `w` (an [E, ., .] weight; the backward's weight
    gradients also pass row-ordered activations and gradients), or of the view of its storage
    given by `shape` and `strides`, with `block_shape`, or None when the layout does not
    allow one (TMA needs a contiguous last dimension and 16-byte aligned base and strides) or
    the GPU has no tensor memory accelerator (before sm_90: the pointer path, as measured there
    before TMA). The interpreter takes descriptors (its tests cover the TMA path on CPU)."""
    if not tma_layout_ok(w, strides):
        return None
    shape = list(w.shape) if shape is None else list(shape)
    strides = list(w.stride()) if strides is None else list(strides)
    from triton.tools.tensor_descriptor import TensorDescriptor

    key = (len(shape), tuple(block_shape))
    fields = _desc_fields.get(key)
    if fields is None or min(shape) <= 0:
        d = TensorDescriptor(w, shape, strides, list(block_shape))   # validates everything
        _desc_fields[key] = {k: v for k, v in vars(d).items()
                             if k not in ("base", "shape", "strides")}
        return d
    # The checks TensorDescriptor's constructor repeats on every call (~5 us of host time per
    # descriptor, two per forward) passed above or depend only on the block shape and rank,
    # validated the first time: copy its other fields (whatever this Triton has) instead.
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(fields)
    d.base, d.shape, d.strides = w, shape, strides
    return d


_desc_fields: dict = {}   # (rank, block shape) -> a validated descriptor's block-only fields
