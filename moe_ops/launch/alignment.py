"""Host side of the alignment kernels. Buffers are sized from shapes alone."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ops._runtime import cdiv, next_pow2
from moe_ops.kernels.alignment import (column_scan_kernel, count_kernel, place_columns_kernel,
                                       place_kernel, scan_kernel)
from moe_ops.launch._common import kernel_for, pdl_args
from moe_ops.launch.fast import launch_key, tensor_key
from moe_ops.reference.alignment import max_padded_rows
from moe_ops.tuning.configs import AlignmentConfig, constrain, constraints_generation

@dataclass
class Alignment:
    sorted_slots: torch.Tensor   # int32 [max_rows]
    block_expert: torch.Tensor   # int32 [max_rows // block_m]
    num_rows: torch.Tensor       # int32 [1], device side
    expert_ends: torch.Tensor    # int32 [E]: end of each expert's padded rows (start = previous end)
    block_m: int
    # int32 [E]: end of each expert's valid rows. expert_ends and valid_ends are the two rows of
    # one [2, E] buffer: the kernels take expert_ends' pointer and find valid_ends E further on.
    valid_ends: torch.Tensor

    @property
    def max_rows(self) -> int:
        return self.sorted_slots.shape[0]


_DEFAULT = AlignmentConfig()
_constrained = (None, _DEFAULT)   # (constraints generation, the default config constrained)


def alignment_config() -> AlignmentConfig:
    """The default alignment config with the config constraints applied (moe_ops.tuning)."""
    global _constrained
    gen = constraints_generation()
    if _constrained[0] != gen:
        _constrained = (gen, constrain(_DEFAULT))
    return _constrained[1]


def align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                 pdl: bool = False, config: AlignmentConfig | None = None) -> Alignment:
    """pdl (sm_90+, moe.dispatch's forward): the kernels launch with programmatic dependent
    launch, wait for their predecessor before reading the ids and let their successor (the next
    alignment kernel, then the gate+up GEMM) launch at once: its programs are resident and waiting
    when the table is complete, instead of being launched after it."""
    cfg = config or alignment_config()
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n_slots = ids.numel()
    max_rows = max_padded_rows(n_slots, num_experts, block_m)
    n_blocks = max_rows // block_m
    if n_slots == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        ends = torch.zeros(2, num_experts, dtype=torch.int32, device=dev)
        return Alignment(empty, empty, torch.zeros(1, dtype=torch.int32, device=dev), ends[0],
                         block_m, ends[1])
    block_e = next_pow2(num_experts)
    chunk = max(16, min(1024, cfg.tile_elems // block_e))
    n_programs = max(1, min(128, cfg.scan_elems // block_e, cdiv(n_slots, chunk)))
    span = cdiv(cdiv(n_slots, n_programs), chunk) * chunk
    n_programs = max(1, cdiv(n_slots, span))
    sorted_slots = torch.empty(max_rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    ends = torch.empty(2, num_experts, dtype=torch.int32, device=dev)   # padded, valid
    expert_ends = ends[0]
    pdl_kw = pdl_args(pdl, dev)
    # fast launch (CUDA): every argument below follows from the ids' layout, E, block_m and pdl
    base = (tensor_key(ids), num_experts, block_m, bool(pdl_kw)) if dev.type == "cuda" else None
    if n_programs == 1:   # decode sizes: one launch, a program per group of table blocks
        block_b = _pow2_floor(min(64, 4096 // (block_e + block_m)))
        fk = launch_key(base and base + (cfg.scan_warps,), sorted_slots, block_expert, num_rows,
                        ends)
        kernel_for(scan_kernel, dev, fk)[(scan_programs(n_blocks, block_b),)](
            ids, sorted_slots, block_expert, num_rows, ends, n_slots, n_blocks,
            num_experts, BLOCK_M=block_m, BLOCK_P=next_pow2(n_slots), BLOCK_E=block_e,
            BLOCK_B=block_b, num_warps=cfg.scan_warps, **pdl_kw)
        return Alignment(sorted_slots, block_expert, num_rows, expert_ends, block_m, ends[1])
    columns = span // chunk >= cfg.columns_min_chunks
    tri = cfg.triangular_rank and chunk <= cfg.triangular_max_chunk and not columns
    # (the config's choices are in the key: a process may align with several configs)
    base = base and base + (tri, columns, cfg.max_column_programs, cfg.column_scan_block)
    if columns:
        _align_columns(ids, sorted_slots, block_expert, num_rows, ends, num_experts, block_m,
                       chunk, block_e, pdl_kw, base, cfg)
    else:
        counts = torch.empty(n_programs, block_e, dtype=torch.int32, device=dev)
        kernel_for(count_kernel, dev, launch_key(base, counts))[(n_programs,)](
            ids, counts, n_slots, span, num_experts, 0, CHUNK=chunk, BLOCK_E=block_e,
            **pdl_kw)
        # each place program owns about n_blocks / n_programs blocks of the table
        block_b = min(next_pow2(cdiv(n_blocks, n_programs)),
                      _pow2_floor(4096 // (block_e + block_m)))
        fk = launch_key(base, counts, sorted_slots, block_expert, num_rows, ends)
        kernel_for(place_kernel, dev, fk)[(n_programs,)](
            ids, counts, sorted_slots, block_expert, num_rows, ends, n_programs, n_slots,
            span, n_blocks, num_experts, CHUNK=chunk, BLOCK_M=block_m,
            BLOCK_P=next_pow2(n_programs), BLOCK_E=block_e, BLOCK_B=block_b, num_warps=8,
            TRI_RANK=tri, **pdl_kw)
    return Alignment(sorted_slots, block_expert, num_rows, expert_ends, block_m, ends[1])


def _align_columns(ids, sorted_slots, block_expert, num_rows, ends, num_experts, block_m, chunk,
                   block_e, pdl_kw, base, cfg):
    """Large T*K: count (per-program histograms, stored expert-major), a scan down each expert's
    row (offsets of every program within the expert, and the totals), then place, each program
    reading only its own offsets: programs of about one chunk each. In-chunk ranks by the
    cumulative sum (the triangular compare was slower here: docs/design.md, alignment)."""
    dev = ids.device
    n_slots = ids.numel()
    n_blocks = block_expert.shape[0]
    n_programs = max(1, min(cfg.max_column_programs, cdiv(n_slots, chunk)))
    span = cdiv(cdiv(n_slots, n_programs), chunk) * chunk
    n_programs = cdiv(n_slots, span)
    counts = torch.empty(block_e, n_programs, dtype=torch.int32, device=dev)
    totals = torch.empty(block_e, dtype=torch.int32, device=dev)
    kernel_for(count_kernel, dev, launch_key(base, counts))[(n_programs,)](
        ids, counts, n_slots, span, num_experts, n_programs, CHUNK=chunk, BLOCK_E=block_e,
        COLUMNS=True, **pdl_kw)
    kernel_for(column_scan_kernel, dev, launch_key(base, counts, totals))[(block_e,)](
        counts, totals, n_programs, BLOCK_P=min(cfg.column_scan_block, next_pow2(n_programs)),
        **pdl_kw)
    block_b = min(next_pow2(cdiv(n_blocks, n_programs)), _pow2_floor(4096 // (block_e + block_m)))
    fk = launch_key(base, counts, totals, sorted_slots, block_expert, num_rows, ends)
    kernel_for(place_columns_kernel, dev, fk)[(n_programs,)](
        ids, counts, totals, sorted_slots, block_expert, num_rows, ends, n_programs, n_slots,
        span, n_blocks, num_experts, CHUNK=chunk, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_B=block_b, num_warps=8, **pdl_kw)


def scan_programs(n_blocks: int, block_b: int) -> int:
    """Programs of the one-launch scan: one per group of block_b table blocks (any smaller count
    is also correct: each program walks every num_programs-th group)."""
    return cdiv(n_blocks, block_b)


def _pow2_floor(n: int) -> int:
    """Largest power of 2 <= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)
