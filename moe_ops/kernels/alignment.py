"""Alignment: token slots sorted by expert into blocks of BLOCK_M rows, on the GPU, no atomics.

One launch (scan_kernel, FUSED) when all slots fit one tile; otherwise three launches over P
programs (each owning a contiguous span of slots, walked in CHUNK pieces): count (per-program expert histogram), scan (one program: prefix sums -> per-expert padded starts,
per-program bases, block -> expert table, padding sentinels, the padded row count), scatter
(each slot's row = its program's base for its expert + its rank among earlier slots of that expert
in the span). Ranks come from a one-hot cumulative sum, so the order within an expert is the slot
order and the result is the same on every run. Layout: moe_ops/reference/alignment.py."""
import triton
import triton.language as tl


@triton.jit
def count_kernel(ids_ptr, counts_ptr, n_slots, span, E,
                 CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    start = pid.to(tl.int64) * span
    for c in range(0, span, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        m = (offs < n_slots) & (offs < start + span)
        ids = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
        valid = m & (ids >= 0) & (ids < E)
        onehot = (ids[:, None] == experts[None, :]) & valid[:, None]
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * BLOCK_E + experts, counts)


@triton.jit
def scan_kernel(ids_ptr, counts_ptr, bases_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                expert_ends_ptr, n_programs, n_slots, n_blocks, E,
                BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_B: tl.constexpr, FUSED: tl.constexpr):
    """FUSED (every slot fits one [BLOCK_P, E] tile, decode sizes): the whole alignment in this
    one launch, slots read from ids_ptr. Otherwise: prefix sums over the count pass's
    [n_programs, E] histogram, writing each program's per-expert bases for the scatter pass."""
    experts = tl.arange(0, BLOCK_E)
    if FUSED:
        offs = tl.arange(0, BLOCK_P)
        m = offs < n_slots
        ids = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
        valid = m & (ids >= 0) & (ids < E)
        onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
        totals = tl.sum(onehot, axis=0)
    else:
        progs = tl.arange(0, BLOCK_P)
        pmask = progs < n_programs
        counts = tl.load(counts_ptr + progs[:, None] * BLOCK_E + experts[None, :],
                         mask=pmask[:, None], other=0)
        totals = tl.sum(counts, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(expert_ends_ptr + experts, ends, mask=experts < E)
    if FUSED:
        rank = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum((rank + starts[None, :]) * onehot, axis=1)
        tl.store(sorted_ptr + row, offs, mask=valid)
    else:
        bases = starts[None, :] + tl.cumsum(counts, axis=0) - counts
        tl.store(bases_ptr + progs[:, None] * BLOCK_E + experts[None, :], bases,
                 mask=pmask[:, None])
    num_rows = tl.sum(padded, axis=0)
    tl.store(num_rows_ptr, num_rows)
    # Padding rows of each expert get the sentinel n_slots.
    for j in range(BLOCK_M - 1):
        r = starts + totals + j
        tl.store(sorted_ptr + r, n_slots, mask=(experts < E) & (totals + j < padded))
    # Block b holds rows [b*BLOCK_M, (b+1)*BLOCK_M): its expert is the number of experts whose
    # padded range ends at or before the block's first row (empty experts end where they start).
    ends_valid = tl.where(experts < E, ends, 2147483647)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        e = tl.sum((ends_valid[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        e = tl.where(first_row < num_rows, e, -1)
        tl.store(block_expert_ptr + blocks, e, mask=blocks < n_blocks)


@triton.jit
def scatter_kernel(ids_ptr, bases_ptr, sorted_ptr, n_slots, span, E,
                   CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    base = tl.load(bases_ptr + pid * BLOCK_E + experts)
    start = pid.to(tl.int64) * span
    for c in range(0, span, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        m = (offs < n_slots) & (offs < start + span)
        ids = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
        valid = m & (ids >= 0) & (ids < E)
        onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum((rank + base[None, :]) * onehot, axis=1)
        tl.store(sorted_ptr + row, offs.to(tl.int32), mask=valid)
        base += tl.sum(onehot, axis=0)
