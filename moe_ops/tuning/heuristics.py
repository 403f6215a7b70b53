"""Kernel configurations from shapes alone (pure functions; no autotuning at call time, which
cannot run inside CUDA-graph capture)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class DispatchConfig:
    block_m: int
    block_n1: int      # gate+up GEMM: columns of I per program
    block_k1: int      # gate+up GEMM: reduction step over H
    block_n2: int      # down GEMM: columns of H per program
    block_k2: int      # down GEMM: reduction step over I
    num_warps: int
    num_stages: int
    group_m: int = 8   # row blocks that walk the N tiles together (L2 reuse)


def dispatch_config(T: int, E: int, K: int, H: int, I: int, device_type: str,
                    dtype: torch.dtype) -> DispatchConfig:
    """A tuned config for this device and shape when a table has one (moe_ops.tuning.tables),
    else the heuristic below."""
    if device_type == "cuda":
        from moe_ops.tuning.tables import lookup

        tuned = lookup(T, E, K, H, I, dtype, _device_name())
        if tuned is not None:
            return tuned
    return heuristic_config(T, E, K, H, I, device_type, dtype)


@functools.lru_cache(maxsize=None)
def _device_name() -> str:
    return torch.cuda.get_device_name()


def heuristic_config(T: int, E: int, K: int, H: int, I: int, device_type: str,
                     dtype: torch.dtype) -> DispatchConfig:
    if device_type != "cuda":
        # Interpreter: numpy runs each program; few large-ish blocks keep tiny tests fast.
        return DispatchConfig(16, 32, 32, 32, 32, 4, 1)
    rows_per_expert = T * K / max(E, 1)
    # Small batches: BLOCK_M near the rows an expert gets, so each expert's weights stream once
    # and little of each tile is padding.
    if rows_per_expert <= 16:
        block_m = 16
    elif rows_per_expert <= 32:
        block_m = 32
    elif rows_per_expert <= 64:
        block_m = 64
    else:
        block_m = 128
    wide = dtype == torch.float32
    if block_m <= 32:
        cfg = DispatchConfig(block_m, 64, 128, 64, 128, 4, 4)
    elif block_m == 64:
        cfg = DispatchConfig(block_m, 64, 64, 128, 64, 4, 4)
    else:
        # H200 sweep (benchmarks/NOTES.md, entry 3): 128x(2*128) gate+up tiles, 8 warps, 3
        # stages won at T >= 2048 on Mixtral, Qwen3 and DeepSeek-V3; a 256-wide down tile paid
        # only with >= 2048 rows per expert (Mixtral T=8192: 10.5 ms vs 10.9 ms).
        cfg = DispatchConfig(block_m, 128, 64, 256 if rows_per_expert >= 2048 else 128, 64, 8, 3)
    if wide:
        # float32 tiles take twice the shared memory per stage.
        cfg = replace(cfg, block_k1=32, block_k2=32, num_stages=3)
    return cfg


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the backward kernels (moe_ops.launch.dispatch_backward). The row block is the
    forward's block_m (the backward walks the same alignment)."""
    act_n: int         # act_grad: columns of I per program
    act_k: int         # act_grad: reduction step over H
    act_warps: int
    wg_m: int          # weight gradients: output tile rows
    wg_n: int          # weight gradients: output tile columns
    wg_k: int          # weight gradients: rows of the expert per step
    wg_warps: int
    dx_n: int          # dx: columns of H per program
    dx_k: int          # dx: reduction step over 2I
    dx_warps: int
    num_stages: int
    split_act: bool = True   # dA GEMM + elementwise pass (False: the fused act_grad_kernel)
    da_n: int = 128    # dA = dO W2_e GEMM: columns of I per program
    da_k: int = 64     # dA GEMM: reduction step over H
    da_warps: int = 4
    ew_r: int = 4      # elementwise pass: rows per program
    ew_i: int = 512    # elementwise pass: columns of I per step


def backward_config(fwd: DispatchConfig, device_type: str, dtype: torch.dtype) -> BackwardConfig:
    if device_type != "cuda":
        return BackwardConfig(32, 32, 1, 32, 32, 16, 1, 32, 32, 1, 1, da_n=32, da_k=32, da_warps=1,
                              ew_r=16, ew_i=32)
    big = fwd.block_m >= 128
    # H200 sweeps at T=8192 (benchmarks/NOTES.md, backward entries): 128x128x64 weight-gradient
    # tiles (128x256: equal on Mixtral, 5% better on Qwen3; 4 stages: slower), 256-wide dx tiles
    # (-12% on Mixtral), a 128-deep act_grad reduction step (-15%).
    cfg = BackwardConfig(act_n=64, act_k=128, act_warps=8 if big else 4,
                         wg_m=128, wg_n=128, wg_k=64, wg_warps=8,
                         dx_n=256 if big else 128, dx_k=64, dx_warps=8 if big else 4, num_stages=3,
                         da_n=256 if big else 128, da_k=64, da_warps=8 if big else 4)
    if dtype == torch.float32:
        cfg = replace(cfg, act_k=32, wg_k=32, dx_n=128, dx_k=32, da_n=128, da_k=32)
    return cfg
