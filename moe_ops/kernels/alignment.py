"""Alignment: token slots sorted by expert into blocks of BLOCK_M rows, on the GPU, no atomics.

One launch (scan_kernel) when all slots fit one tile; otherwise P programs, each owning a
contiguous span of slots walked in CHUNK pieces: count (per-program expert histogram), then
place: a program derives the per-expert padded starts and its own per-expert bases, scatters
its span (each slot's row = its base for its expert + its rank among earlier slots of that
expert in the span) and writes its share of the block -> expert table and of the padding
sentinels (program 0 also the padded row count and the expert ends, padded and valid). In the
two-launch form every place program reads the whole [P, E] histogram (from L2), which bounds
P; for large T*K a column scan between them (column_scan_kernel: one program per expert, the
offsets of every program within that expert) lets place read only its own offsets, so there
are more programs of about one chunk each (docs/design.md). Ranks come from a
one-hot cumulative sum or a triangular compare, so the order within an expert is the slot
order and the result is the same on every run. Layout: moe_ops/reference/alignment.py. (A
one-program scan between count and scatter, with the sentinels in a BLOCK_M-step loop, took
26-59 us at T = 2048-8192: docs/design.md.)"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """USE_PDL (launched with launch_pdl=True): wait for the predecessor (the ids' producer may
    still be running), then let the successor launch; it waits for this grid's completion
    before it reads what this kernel writes."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def load_ids(ptrs, mask, E):
    """(ids as int32, valid): valid = mask and 0 <= id < E, tested on the ids' own width (an
    int64 id below -2^31 must not wrap to a valid expert when narrowed); invalid ids read -1."""
    raw = tl.load(ptrs, mask=mask, other=-1)
    valid = mask & (raw >= 0) & (raw < E)
    return tl.where(valid, raw, -1).to(tl.int32), valid


@triton.jit
def count_kernel(ids_ptr, counts_ptr, n_slots, span, E, counts_pstride,
                 CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = False,
                 COLUMNS: tl.constexpr = False):
    """Each program's expert histogram of its span of slots: counts[pid, e] ([P, BLOCK_E]), or
    with COLUMNS counts[e, pid] ([BLOCK_E, P]: row e is expert e's counts over the programs, for
    column_scan_kernel)."""
    pid = tl.program_id(0)
    pdl_start(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    start = pid.to(tl.int64) * span
    for c in range(0, span, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        m = (offs < n_slots) & (offs < start + span)
        ids, valid = load_ids(ids_ptr + offs, m, E)
        onehot = (ids[:, None] == experts[None, :]) & valid[:, None]
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    if COLUMNS:
        tl.store(counts_ptr + experts * counts_pstride + pid, counts)
    else:
        tl.store(counts_ptr + pid * BLOCK_E + experts, counts)


@triton.jit
def scan_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, expert_ends_ptr, n_slots,
                n_blocks, E, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Decode sizes (every slot fits one [BLOCK_P, E] tile): the whole alignment in one launch.
    Each program derives the expert ranges from all the ids (a few dozen) and writes one group
    of BLOCK_B blocks of the block table and their padding sentinels; program 0 also scatters
    the slots and writes the ranges (one program walking every group took 7.5 us at Qwen3
    T=8: H200)."""
    pid = tl.program_id(0)
    pdl_start(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, BLOCK_P)
    m = offs < n_slots
    ids, valid = load_ids(ids_ptr + offs, m, E)
    onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
    totals = tl.sum(onehot, axis=0)
    starts, ends, num_rows = expert_ranges(totals, BLOCK_M)
    if pid == 0:
        store_ranges(expert_ends_ptr, num_rows_ptr, experts, starts, ends, totals, num_rows, E)
        rank = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum((rank + starts[None, :]) * onehot, axis=1)
        tl.store(sorted_ptr + row, offs, mask=valid)
    block_table(sorted_ptr, block_expert_ptr, starts + totals, ends, experts, num_rows, n_slots,
                pid, n_blocks, tl.num_programs(0), E, BLOCK_M, BLOCK_E, BLOCK_B)


@triton.jit
def expert_ranges(totals, BLOCK_M: tl.constexpr):
    """(starts, ends, num_rows) of the experts' padded row ranges, from their slot counts: each
    expert's rows padded to a multiple of BLOCK_M, experts in ascending order."""
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends, tl.sum(padded, axis=0)


@triton.jit
def store_ranges(expert_ends_ptr, num_rows_ptr, experts, starts, ends, totals, num_rows, E):
    """The [2, E] ends buffer (padded ends, then valid ends: start + count) and the padded row
    count."""
    tl.store(expert_ends_ptr + experts, ends, mask=experts < E)
    tl.store(expert_ends_ptr + E + experts, starts + totals, mask=experts < E)
    tl.store(num_rows_ptr, num_rows)


@triton.jit
def block_table(sorted_ptr, block_expert_ptr, valid_ends, ends, experts, num_rows, n_slots,
                first_block, n_blocks, block_step, E, BLOCK_M: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """Blocks first_block, first_block + block_step*BLOCK_B, ... (in groups of BLOCK_B): each
    block's expert (the number of experts whose padded range ends at or before the block's first
    row; empty experts end where they start; -1 past num_rows) and the padding sentinel n_slots
    in its rows at or past its expert's last valid row."""
    ends_valid = tl.where(experts < E, ends, 2147483647)
    for b0 in range(first_block * BLOCK_B, n_blocks, block_step * BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        live = first_row < num_rows
        e = tl.sum((ends_valid[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(live, e, -1), mask=blocks < n_blocks)
        vend = tl.sum(tl.where(experts[None, :] == e[:, None], valid_ends[None, :], 0), axis=1)
        r = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
        pad = live[:, None] & (r >= vend[:, None])
        tl.store(sorted_ptr + r, tl.zeros((BLOCK_B, BLOCK_M), tl.int32) + n_slots, mask=pad)


@triton.jit
def place_chunk(sorted_ptr, offs, ids, valid, base, experts, CHUNK: tl.constexpr,
                TRI_RANK: tl.constexpr):
    """Scatters one chunk of slots (each to its expert's base + its rank among the chunk's
    earlier slots of that expert); returns the bases moved past the chunk. TRI_RANK: ranks by a
    [CHUNK, CHUNK] triangular compare and row sums, else by a cumulative sum down the one-hot
    [CHUNK, E] tile."""
    onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
    if TRI_RANK:
        j = tl.arange(0, CHUNK)
        same = (ids[:, None] == ids[None, :]) & valid[None, :] & (j[None, :] < j[:, None])
        rank = tl.sum(same.to(tl.int32), axis=1)
        row = tl.sum(onehot * base[None, :], axis=1) + rank
    else:
        rank = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum((rank + base[None, :]) * onehot, axis=1)
    tl.store(sorted_ptr + row, offs.to(tl.int32), mask=valid)
    return base + tl.sum(onehot, axis=0)


@triton.jit
def place_span(ids_ptr, sorted_ptr, base, experts, pid, span, n_slots, E, CHUNK: tl.constexpr,
               TRI_RANK: tl.constexpr):
    """Program pid's span of slots scattered chunk by chunk from its per-expert bases (the rows
    of the slots of earlier programs come first)."""
    start = pid.to(tl.int64) * span
    for c in range(0, span, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        m = (offs < n_slots) & (offs < start + span)
        ids, valid = load_ids(ids_ptr + offs, m, E)
        base = place_chunk(sorted_ptr, offs, ids, valid, base, experts, CHUNK, TRI_RANK)


@triton.jit
def place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                 expert_ends_ptr, n_programs, n_slots, span, n_blocks, E,
                 CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr = False,
                 TRI_RANK: tl.constexpr = False):
    pid = tl.program_id(0)
    pdl_start(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    progs = tl.arange(0, BLOCK_P)
    counts = tl.load(counts_ptr + progs[:, None] * BLOCK_E + experts[None, :],
                     mask=(progs < n_programs)[:, None], other=0)
    totals = tl.sum(counts, axis=0)
    starts, ends, num_rows = expert_ranges(totals, BLOCK_M)
    if pid == 0:
        store_ranges(expert_ends_ptr, num_rows_ptr, experts, starts, ends, totals, num_rows, E)
    # this program's span: rows from its bases (the slots of earlier programs come first)
    base = starts + tl.sum(tl.where(progs[:, None] < pid, counts, 0), axis=0)
    place_span(ids_ptr, sorted_ptr, base, experts, pid, span, n_slots, E, CHUNK, TRI_RANK)
    block_table(sorted_ptr, block_expert_ptr, starts + totals, ends, experts, num_rows, n_slots,
                pid, n_blocks, n_programs, E, BLOCK_M, BLOCK_E, BLOCK_B)


@triton.jit
def column_scan_kernel(counts_ptr, totals_ptr, n_programs, BLOCK_P: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    """Program e: expert e's counts over the count programs (row e of [BLOCK_E, P]) replaced by
    their exclusive prefix sums (each place program's offset within the expert), and the total
    in totals[e]."""
    e = tl.program_id(0)
    pdl_start(USE_PDL)
    row = counts_ptr + e.to(tl.int64) * n_programs
    carry = 0
    for p0 in range(0, n_programs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        c = tl.load(row + p, mask=p < n_programs, other=0)
        tl.store(row + p, carry + tl.cumsum(c, axis=0) - c, mask=p < n_programs)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + e, carry)


@triton.jit
def place_columns_kernel(ids_ptr, offsets_ptr, totals_ptr, sorted_ptr, block_expert_ptr,
                         num_rows_ptr, expert_ends_ptr, n_programs, n_slots, span, n_blocks, E,
                         CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr = False,
                         TRI_RANK: tl.constexpr = False):
    """place_kernel after column_scan_kernel: a program reads the experts' totals and its own
    offsets (2 * BLOCK_E values) instead of the whole [P, E] histogram, so P is not bounded by
    one tile and each program walks one or two chunks."""
    pid = tl.program_id(0)
    pdl_start(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    totals = tl.load(totals_ptr + experts)
    starts, ends, num_rows = expert_ranges(totals, BLOCK_M)
    if pid == 0:
        store_ranges(expert_ends_ptr, num_rows_ptr, experts, starts, ends, totals, num_rows, E)
    base = starts + tl.load(offsets_ptr + experts.to(tl.int64) * n_programs + pid)
    place_span(ids_ptr, sorted_ptr, base, experts, pid, span, n_slots, E, CHUNK, TRI_RANK)
    block_table(sorted_ptr, block_expert_ptr, starts + totals, ends, experts, num_rows, n_slots,
                pid, n_blocks, n_programs, E, BLOCK_M, BLOCK_E, BLOCK_B)
