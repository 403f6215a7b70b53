"""Reference for the alignment metadata: token slots sorted by expert into blocks of BLOCK_M rows.

Layout (shared with the Triton kernels, compared exactly in tests):
- `sorted_slots` int32 [max_rows]: rows [0, num_rows) hold, expert by expert in ascending order,
  that expert's slots `t*K + k` in ascending order, then padding up to a multiple of BLOCK_M filled
  with the sentinel `T*K`. Rows at or past num_rows are never read.
- `block_expert` int32 [max_rows // BLOCK_M]: the expert of each block, -1 past num_rows.
- `num_rows` int32 [1]: the padded row count (a device tensor: no host sync).
Ids < 0 or >= E are dropped.
"""
from __future__ import annotations

import torch


def max_padded_rows(n_slots: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on padded rows: at most min(E, T*K) experts are hit, each padded by at
    most BLOCK_M - 1 rows; rounded up to a whole block."""
    bound = n_slots + min(num_experts, n_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    flat = topk_ids.reshape(-1).long()
    n_slots = flat.numel()
    max_rows = max_padded_rows(n_slots, num_experts, block_m)
    sorted_slots = torch.full((max_rows,), n_slots, dtype=torch.int32)
    block_expert = torch.full((max_rows // block_m,), -1, dtype=torch.int32)
    row = 0
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten()
        n = slots.numel()
        if n == 0:
            continue
        sorted_slots[row:row + n] = slots.to(torch.int32)
        padded = -(-n // block_m) * block_m
        block_expert[row // block_m:(row + padded) // block_m] = e
        row += padded
    return sorted_slots, block_expert, torch.tensor([row], dtype=torch.int32)
