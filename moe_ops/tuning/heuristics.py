"""Kernel configurations from shapes alone (pure functions; no autotuning at call time, which
cannot run inside CUDA-graph capture)."""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, replace

import torch

from moe_ops._runtime import env_flag


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
    tma: bool = False  # weight tiles through tensor descriptors (where the layout allows)
    direct: bool = False  # T == 1: slot k is row block k, no alignment launch
    fuse_combine: bool = False  # T == 1 with direct rows: the combine folded into the down GEMM
    pdl: bool = False  # programmatic dependent launch of the forward's kernels (sm_90+)
    tma_pair: bool = False  # with tma: gate and up weight tiles in one copy, one product
    half_tail: bool = False  # tail row blocks (<= block_m/2 valid rows) on a half-height tile
    combine_last: bool = False  # T == 1, direct rows: the down kernel's last program combines
    down_ws: bool = False  # down GEMM: persistent warp-specialised kernel (128-row blocks, sm_90)
    tma_a: bool = False  # down GEMM: the act tiles (aligned rows, contiguous) through TMA too


def dispatch_config(T: int, E: int, K: int, H: int, I: int, device_type: str,
                    dtype: torch.dtype) -> DispatchConfig:
    """A tuned config for this device and shape when a table has one (moe_ops.tuning.tables),
    else the heuristic below. Memoised: every moe.dispatch call asks, and building a config
    (the heuristic's chain of dataclasses.replace, the table's nearest-T search) cost ~35 us of
    host time per call (benchmarks/NOTES.md, entry 22). The key holds what the answer depends
    on: the shape, the device's name and the tuning folder; writing a table clears it."""
    if device_type == "cuda":
        return _cached_config(T, E, K, H, I, device_type, dtype, _device_name(),
                              os.environ.get("MOE_OPS_TUNING_DIR"))
    return _cached_config(T, E, K, H, I, device_type, dtype, None, None)


@functools.lru_cache(maxsize=4096)
def _cached_config(T, E, K, H, I, device_type, dtype, device_name, tuning_dir) -> DispatchConfig:
    if device_type == "cuda":
        from moe_ops.tuning.tables import lookup

        tuned = lookup(T, E, K, H, I, dtype, device_name, tuning_dir)
        if tuned is not None:
            return tuned if warp_specialize_enabled() else replace(tuned, down_ws=False)
    return heuristic_config(T, E, K, H, I, device_type, dtype)


def warp_specialize_enabled() -> bool:
    """Whether the heuristics (and tuned tables) may choose the warp-specialised kernels
    (DispatchConfig.down_ws, BackwardConfig.wg_ws / rows_ws). Off unless MOE_OPS_WARP_SPECIALIZE=1,
    and unsafe: on the H200 (Triton 3.6) their outputs hold NaN and stale values whenever
    another process uses the same GPU (reproduced in every run with one other process running
    matmuls, never in ~2600 runs alone; the same kernels compiled without Triton's
    warp-specialisation pass stay exact under sharing: benchmarks/NOTES.md, entry 28), and a
    minimal warp-specialised GEMM in the style of Triton's tutorial is wrong on that Triton even
    alone (entry 31). Enabling it warns once. Read when a config is first made
    (configs are memoised: clear_config_cache after changing it). A config passed explicitly is
    used as given."""
    if not env_flag("MOE_OPS_WARP_SPECIALIZE"):
        return False
    global _ws_warned
    if not _ws_warned:
        _ws_warned = True
        warnings.warn("moe_ops: MOE_OPS_WARP_SPECIALIZE=1 enables warp-specialised kernels whose "
                      "outputs are wrong (NaN, stale values) when another process uses the same "
                      "GPU, and Triton 3.6's warp specialisation on Hopper miscompiles even a "
                      "minimal GEMM (benchmarks/NOTES.md entries 28, 31): use it only on a GPU "
                      "this process has to itself, and check its outputs", RuntimeWarning,
                      stacklevel=2)
    return True


_ws_warned = False


def clear_config_cache() -> None:
    """Forget memoised configs (after a tuned table changed on disk)."""
    _cached_config.cache_clear()
    _backward_config.cache_clear()


@functools.lru_cache(maxsize=None)
def _device_name() -> str:
    return torch.cuda.get_device_name()


def heuristic_config(T: int, E: int, K: int, H: int, I: int, device_type: str,
                     dtype: torch.dtype) -> DispatchConfig:
    if device_type != "cuda":
        # Interpreter: numpy runs each program; few large-ish blocks keep tiny tests fast.
        return DispatchConfig(16, 32, 32, 32, 32, 4, 1)
    rows_per_expert = T * K / max(E, 1)
    # Small batches: one row block per expert, so each expert's weights stream once. Routed
    # counts scatter around the mean (~Poisson), so the block is sized for mean + 2 sd: with
    # BLOCK_M at the mean, half the experts took two blocks and read their weights twice. H200
    # sweep (benchmarks/NOTES.md, entry 11): Mixtral T=128 (32 rows/expert) 796 -> 697 us with
    # BLOCK_M 64 instead of 32; DeepSeek-V3 T=512 (16 rows) 5966 -> 5138 us with 32 instead of
    # 16; T=2048 (64 rows) 6471 -> 6255 us with 128 instead of 64.
    need = rows_per_expert + 2.0 * rows_per_expert ** 0.5
    block_m = 16 if need <= 16 else 32 if need <= 32 else 64 if need <= 64 else 128
    wide = dtype == torch.float32
    if block_m <= 64:
        # Weight-streaming: 4-warp programs, 128-deep steps. A 128-wide down tile when it still
        # leaves a program per SM: at BLOCK_M <= 32 on wide hidden sizes only (Mixtral T=8:
        # 604 -> 570 us; DeepSeek-V3 T=512: -0.5%; Qwen3 zipf T=512 at BLOCK_M 32, H = 2048:
        # +7%), at BLOCK_M 64 on any H (entry 16: Qwen3 zipf T=512 445 -> 397 us, Mixtral T=128
        # 712 -> 690 us).
        row_blocks = max(min(E, T * K), T * K / block_m)
        wide_down = (block_m == 64 or H >= 4096) and row_blocks * H / 128 >= 132
        cfg = DispatchConfig(block_m, 64, 128, 128 if wide_down else 64, 128, 4, 4)
    else:
        # H200 sweeps (NOTES.md, entries 3 and 11): 128x(2*128) gate+up tiles, 8 warps, 3
        # stages. A 256-wide down tile pays on Mixtral's long down reduction (I = 14336: T=512
        # 1152 -> 1128 us, T=8192 10.9 -> 10.5 ms) and costs on DeepSeek-V3 (I = 2048, +4%).
        # With TMA weight tiles (below) a 4th stage pays up to T=2048 and costs at T=8192
        # (entry 16: Mixtral T=2048 2775 -> 2707 us, T=8192 9752 -> 11983 us).
        # Also on wide H with >= 256 rows per expert (entry 16: DeepSeek-V3 T=8192 13383 ->
        # 13018 us with TMA, 14695 -> 14096 without).
        n2 = 256 if I >= 8192 or (H >= 4096 and rows_per_expert >= 256) else 128
        # Tail row blocks with <= 64 valid rows on a 64-row tile (NOTES.md, entry 18: 0.5-4%
        # in each of 8 prefill cells, e.g. OLMoE T=2048 561 -> 537 us, Qwen3 T=8192 1483 ->
        # 1445).
        cfg = DispatchConfig(block_m, 128, 64, n2, 64, 8, 4 if T <= 4096 else 3, half_tail=True)
    if wide:
        # float32 tiles take twice the shared memory per stage.
        cfg = replace(cfg, block_k1=32, block_k2=32, num_stages=3)
    else:
        # Weight tiles through TMA descriptors (16-bit weights; float32 never measured). H200,
        # entry 16: Mixtral T=512/2048/8192 -4/-4/-6%, DeepSeek-V3 T=8192 -6%, 0 to -1.5% at
        # BLOCK_M <= 64.
        cfg = replace(cfg, tma=True)
        if block_m == 16 and T > 1 and E >= 64:
            # Many small experts, several tokens: 32-wide gate+up strips (twice the programs,
            # a finer last wave) in 256-deep steps, 3 stages (the same bytes in flight). H200,
            # NOTES.md entry 21, graph replay: Qwen3 T=8 138.4 -> 135.9 us, OLMoE T=8 146.9 ->
            # 139.2, Qwen3 zipf T=8 106.8 -> 102.0, T=32/128 -0.6 to -1.7%, DeepSeek-V3 T=8
            # -1.1%; at T=1 (8 experts x 24 strips: 1.45 waves) +1.7 us, Mixtral +0.2-0.4%.
            # (num_stages is shared: the down GEMM runs 3 stages too, as measured.)
            cfg = replace(cfg, block_n1=32, block_k1=256, num_stages=3)
        if block_m == 128:
            # Gate and up tiles in one TMA copy and one N=256 product, and 256-wide down tiles
            # on every shape (entry 18, graph replay: the pair -0.5 to -6% in 10 of 11 prefill
            # cells, Mixtral T=8192 9326 -> 8826 us, DeepSeek-V3 T=8192 12761 -> 11974; the
            # 256-wide down tile -4 to -8% on the H = 2048 shapes at T <= 2048, e.g. Qwen3
            # T=2048 489 -> 452, and DeepSeek-V3 T=2048 6047 -> 5749; Qwen3 T=8192 +1.7%,
            # within the spread).
            # The down GEMM's act tiles through TMA too (contiguous aligned rows; NOTES.md
            # entry 30, graph replay: Qwen3 T=2048/8192 468 -> 461 / 1354 -> 1285 us, OLMoE
            # T=2048 473 -> 462, Mixtral T=512 1032 -> 1018; Mixtral and DeepSeek-V3 T=8192
            # within +-0.3%; at BLOCK_M <= 64 0.1-1.6% slower in 8 of 8 decode cells).
            cfg = replace(cfg, tma_pair=True, block_n2=256, tma_a=True)
            if (rows_per_expert >= 256 or E <= 16) and warp_specialize_enabled():
                # The down GEMM as a persistent warp-specialised kernel (a producer warp group
                # for the TMA copies, two consumer groups; no half-height tails). H200,
                # NOTES.md entry 24, graph replay, best of 5: Qwen3 T=4096/8192 -3.7/-2.3%,
                # zipf T=8192 -3.6%, Mixtral T=512/1024 -2.3/-2.9%, DeepSeek-V3 T=8192 -1.4%,
                # OLMoE T=2048/8192 and Mixtral T=2048 within +-0.3%. Below 256 rows per
                # expert the half-height tails it gives up cost more: Qwen3 T=2048 +0.6%,
                # OLMoE T=512 +1.3%, DeepSeek-V3 T=4096 +1.0%.
                cfg = replace(cfg, down_ws=True)
    # Programmatic dependent launch (sm_90+; ignored elsewhere): each kernel's launch overlaps
    # its predecessor's tail (entry 17: Qwen3 T=1 36.5 -> 35.5 us, T=8 142.4 -> 140.6, OLMoE
    # T=1 43.5 -> 42.3; 0.3-1 us on the other cells measured).
    cfg = replace(cfg, pdl=True)
    # One token: no alignment launch (entry 16: Qwen3 T=1 40.6 -> 37.6 us). The combine folded
    # into the down GEMM pays only where its grid (one program per 32 columns of H) still covers
    # the SMs at least 1.5 times over: DeepSeek-V3 T=1 183 -> 177 us; Qwen3/OLMoE (64 programs)
    # +6/+11%, Mixtral (128) +2% (entry 17).
    # Elsewhere at T=1 the down kernel's last program per H tile does the combine (entry 18:
    # Qwen3 34.5 -> 34.1 us, OLMoE 42.0 -> 41.2, Qwen3 zipf 35.7 -> 34.9, Mixtral unchanged).
    # A few tokens over many experts (T * K <= 32, E >= 64, 16-bit): direct rows as well, slot s
    # as row block s, no alignment launch. Slots that share an expert read its weight tiles again
    # (from L2: the grids walk column tiles with every slot together), which costs ~1/4 of a
    # weight-streaming program each; with up to ~20% of the slots shared (uniform routing at
    # T * K <= 32 on 64+ experts) that is less than the ~7 us alignment launch, with ~30% and
    # more it is not. H200, graph replay (NOTES.md entry 36): T=2 Qwen3 56.8 -> 54.0 us,
    # zipf 53.6 -> 48.9, OLMoE 63.5 -> 60.9, DeepSeek-V3 336.5 -> 333.1; T=4 Qwen3 89.8 ->
    # 86.8, OLMoE 95.5 -> 93.1, DeepSeek-V3 611.1 -> 604.5, zipf 65.1 -> 66.3; T=8 Qwen3 and
    # DeepSeek-V3 +0.4 / +0.2%, OLMoE +9%; Mixtral (8 experts) T=2 +6%.
    if 1 < T and T * K <= 32 and E >= 64 and not wide:
        cfg = replace(cfg, direct=True)
    if T == 1:
        cfg = replace(cfg, direct=True)
        if not wide and H >= 32 * 198:
            cfg = replace(cfg, fuse_combine=True, block_n2=32, block_k2=256)
        else:
            cfg = replace(cfg, combine_last=True)
            if not wide and I >= 8192:
                # Long weight streams per program (the down GEMM's I-long rows, one program per
                # 64 columns of H on ~128 SMs): a 5th stage keeps more bytes in flight per SM.
                # H200, NOTES.md entry 44, graph replay, two runs: Mixtral T=1 193.6 -> 183.3,
                # 193.8 -> 183.1 us (6 stages 183.9); not at T=8 (576 -> 591), nor on the short
                # streams of Qwen3 / OLMoE T=1 (+0.4-0.8 us) or DeepSeek-V3's folded combine
                # (176.5 -> 181.3).
                cfg = replace(cfg, num_stages=5)
    return cfg


def neighbours(base: DispatchConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, DispatchConfig]:
    """A dozen variants of a heuristic config, named: the ones the H200 sweeps of
    benchmarks/NOTES.md (entries 11-12) found to matter per regime. `benchmarks/sweep_forward.py`
    times them; `moe-ops-tune --quick` picks the best of them per token count (~10
    candidates instead of ~100). float32 variants keep 32-deep steps and <= 3 stages (shared
    memory). Duplicates of the base or of each other are dropped; the base comes first."""
    r = replace
    if base.block_m <= 32:
        cands = {
            "s5": r(base, num_stages=5),
            "gate/up n128": r(base, block_n1=128, block_k1=64),
            "gate/up n32": r(base, block_n1=32),
            "gate/up n32 k256 s3": r(base, block_n1=32, block_k1=256, num_stages=3),
            "k256 s3": r(base, block_k1=256, block_k2=256, num_stages=3),
            "down n128": r(base, block_n2=128),
            "down n64": r(base, block_n2=64),
            "bm/2": r(base, block_m=max(16, base.block_m // 2)),
            "bm*2": r(base, block_m=base.block_m * 2),
            "w8": r(base, num_warps=8),
        }
    elif base.block_m == 64:
        cands = {
            "gate/up n128": r(base, block_n1=128, block_k1=64),
            "gate/up n128 w8 s3": r(base, block_n1=128, block_k1=64, num_warps=8, num_stages=3),
            "down n128": r(base, block_n2=128),
            "bm 32": DispatchConfig(32, 64, 128, 64, 128, 4, 4),
            "bm 128": DispatchConfig(128, 128, 64, 128, 64, 8, 3),
        }
    else:
        cands = {
            "g16": r(base, group_m=16),
            "g4": r(base, group_m=4),
            "down n256" if base.block_n2 != 256 else "down n128": r(
                base, block_n2=256 if base.block_n2 != 256 else 128),
            "bm 64": DispatchConfig(64, 128, 64, 128, 64, 8, 3),
            "bm 64 w4 s4": DispatchConfig(64, 64, 64, 128, 64, 4, 4),
        }
    cands["no tma" if base.tma else "tma"] = r(base, tma=not base.tma)
    cands["no tma a" if base.tma_a else "tma a"] = r(base, tma_a=not base.tma_a)
    if base.block_m == 16:
        cands["no direct" if base.direct else "direct"] = r(base, direct=not base.direct)
    if base.direct:
        fc = not base.fuse_combine
        cands["fused" if fc else "unfused"] = r(base, fuse_combine=fc)
        cands["fused n16" if fc else "n16"] = r(base, fuse_combine=True, block_n2=16)
        cands["fused n16 k256" if fc else "n16 k256"] = r(base, fuse_combine=True, block_n2=16,
                                                           block_k2=256)
        cands["fused n32" if fc else "n32"] = r(base, fuse_combine=True, block_n2=32)
        cands["fused n32 k256" if fc else "n32 k256"] = r(base, fuse_combine=True,
                                                           block_n2=32, block_k2=256)
    cands["no pdl" if base.pdl else "pdl"] = r(base, pdl=not base.pdl)
    if base.direct and not base.fuse_combine:
        cands["combine kernel" if base.combine_last else "combine last"] = r(
            base, combine_last=not base.combine_last)
    if base.block_m >= 64:
        cands["no half tail" if base.half_tail else "half tail"] = r(base,
                                                                     half_tail=not base.half_tail)
    if base.tma:
        cands["tma unpaired" if base.tma_pair else "tma pair"] = r(base, tma_pair=not base.tma_pair)
    if base.block_m == 128:
        cands["s3" if base.num_stages != 3 else "s4"] = r(
            base, num_stages=3 if base.num_stages != 3 else 4)
        cands["down per tile" if base.down_ws else "down ws"] = r(base, down_ws=not base.down_ws)
    out = {"heuristic": base}
    seen = {base}
    for name, cfg in cands.items():
        if dtype == torch.float32:
            cfg = r(cfg, block_k1=min(cfg.block_k1, 32), block_k2=min(cfg.block_k2, 32),
                    num_stages=min(cfg.num_stages, 3))
        if cfg not in seen:
            seen.add(cfg)
            out[name] = cfg
    return out


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the backward kernels (moe_ops.launch.dispatch_backward). The row block is the
    forward's block_m (the backward walks the same alignment)."""
    wg_m: int          # weight gradients: output tile rows
    wg_n: int          # weight gradients: output tile columns
    wg_k: int          # weight gradients: rows of the expert per step
    wg_warps: int
    dx_n: int          # dx: columns of H per program
    dx_k: int          # dx: reduction step over 2I
    dx_warps: int
    num_stages: int
    da_n: int = 128    # dA = dO W2_e GEMM: columns of I per program
    da_k: int = 64     # dA GEMM: reduction step over H
    da_warps: int = 4
    ew_r: int = 4      # elementwise pass: rows per program
    # elementwise pass: columns of I per step (H200, T=8192, NOTES.md entry 34: 512 -> 256 took
    # the pass from 0.25-0.27 to 0.18 ms on Qwen3, 0.30 -> 0.24 OLMoE, 0.62 -> 0.55 DeepSeek-V3)
    ew_i: int = 256
    tma: bool = False  # dA and dx weight tiles through tensor descriptors
    tma_a: bool = False  # dA and dx: their A tiles (gathered dO, dz rows) through TMA
    half_tail: bool = False  # dA and dx: tail row blocks on a half-height tile (as the forward)
    wg_trim: bool = True  # weight gradients stop at the expert's valid rows (not its padding)
    wg_persistent: bool = False  # weight gradients: one program per SM walking output tiles
    wg_stages: int = 0    # pipeline stages of the persistent weight-gradient loop (0: num_stages)
    wg_chunk: int = 32    # persistent weight gradients: tiles per bookkeeping chunk (<= 32, 2^n)
    wg_split: int = 1     # persistent weight gradients: column slices per tile store (1, 2, 4)
    wg_ws: bool = False   # persistent weight gradients warp-specialised (sm_90, 16-bit, M % wg_m == 0)
    rows_ws: bool = False  # dA and dx GEMMs: the forward's warp-specialised row GEMM (down_ws)
    wg_per_sm: int = 1    # persistent weight gradients: programs per SM (co-resident if they fit)
    # persistent weight gradients: tiles of the experts with the most rows first, dealt in
    # snaking rounds where the routing is skewed (bitwise the same sums; on in the heuristics)
    wg_lpt: bool = False
    # dA = dO W2_e stored in the input dtype (16-bit) instead of float32: half its write and
    # its read by the elementwise pass, one more rounding of dA (NOTES.md entry 58)
    da_half: bool = False


def backward_config(fwd: DispatchConfig, device_type: str, dtype: torch.dtype,
                    rows_per_expert: float = 0.0, inter_size: int = 0) -> BackwardConfig:
    """rows_per_expert: the mean aligned rows per expert, T*K/E (0: unknown, as for large T);
    inter_size: the experts' I (0: unknown). Memoised (every backward asks; the chain of
    dataclasses.replace below costs host time), with warp_specialize_enabled() in the key."""
    ws = device_type == "cuda" and dtype != torch.float32 and warp_specialize_enabled()
    return _backward_config(fwd, device_type, dtype, rows_per_expert, inter_size, ws)


@functools.lru_cache(maxsize=4096)
def _backward_config(fwd: DispatchConfig, device_type: str, dtype: torch.dtype,
                     rows_per_expert: float, inter_size: int, ws: bool) -> BackwardConfig:
    if device_type != "cuda":
        return BackwardConfig(32, 32, 16, 1, 32, 32, 1, 1, da_n=32, da_k=32, da_warps=1,
                              ew_r=16, ew_i=32)
    big = fwd.block_m >= 128
    # H200 sweeps at T=8192 (benchmarks/NOTES.md, backward entries and entry 10): 128x256x64
    # weight-gradient tiles with 4 stages (Mixtral 22.4 -> 19.9 ms backward, DeepSeek-V3 33.5 ->
    # 32.1, Qwen3 3.49 -> 3.17, OLMoE 3.88 -> 3.53), 256-wide dx and dA tiles.
    cfg = BackwardConfig(wg_m=128, wg_n=256, wg_k=64, wg_warps=8,
                         dx_n=256 if big else 128, dx_k=64, dx_warps=8 if big else 4, num_stages=4,
                         da_n=256 if big else 128, da_k=64, da_warps=8 if big else 4)
    if dtype == torch.float32:
        # float32 tiles take twice the shared memory per stage.
        return replace(cfg, wg_n=128, wg_k=32, dx_n=128, dx_k=32, da_n=128, da_k=32, num_stages=3)
    # The dA and dx GEMMs' A tiles (gathered dO rows, dz rows) through TMA where I is narrow
    # (NOTES.md entry 30, T=8192 row-GEMM kernel ms: Qwen3 1.11 -> 1.09; Mixtral 8.60 -> 8.80;
    # the whole backward within +-1% on Qwen3/OLMoE over 3 rounds: neutral, kept as measured
    # in the training tables).
    if 0 < inter_size <= 1024:
        cfg = replace(cfg, tma_a=True)
    # Persistent weight gradients (3 stages: the store's staging tile takes the 4th). First
    # adopted below 1024 mean rows per expert (NOTES.md entry 19); since its bookkeeping left the
    # product loop (entry 32) it beats the per-tile kernel at every T measured (backward ms,
    # per-tile or old persistent -> now, T = 2048/8192/32768): Qwen3 1.12/2.93/10.34 ->
    # 1.11/2.86/10.21, OLMoE 1.12/3.35/12.86 -> 1.09/3.19/12.55, Mixtral 5.89/19.75/77.01 ->
    # 5.50/19.37/74.56, DeepSeek-V3 14.09/28.88/89.16 -> 13.94/26.64/84.18. Split stores with a
    # 4th stage (wg_split 2/4) were within +-2% of it, neither way throughout.
    # The LPT deal (BackwardConfig.wg_lpt): largest experts' tiles first in snaking rounds where
    # the routing is skewed (largest expert > 2x the mean rows, decided in the kernel), else the
    # fixed deal. H200, NOTES.md entry 56, T=8192, benchmark routing, backward ms fixed -> LPT
    # (best of 5 alternating rounds): Qwen3 zipf 3.017 -> 2.844 (weight-gradient kernels 1.49 ->
    # 1.20); near-uniform DeepSeek-V3 26.59 -> 26.60, OLMoE 3.309 -> 3.324 (the ranking and the
    # per-chunk order load are skipped there by runtime branches), but Qwen3 2.847 -> 2.900 (a
    # second run, best of 10: 2.838 -> 2.871, zipf 3.043 -> 2.923): a +1.2-1.9% residue on
    # near-uniform Qwen3 in those runs, gone in entry 58's replicate (8 rounds: 2.853 -> 2.844
    # eager, 2.893 -> 2.892 graph replay), i.e. run-to-run spread; against -3.9 to -5.7% where
    # the routing is skewed.
    cfg = replace(cfg, wg_persistent=True, wg_stages=3, wg_lpt=True)
    # The warp-specialised persistent weight-gradient kernel (same tiles and sums, bitwise equal;
    # it applies where the output rows are a multiple of 128, else the kernels above run).
    # H200, NOTES.md entry 24, T=8192, weight-gradient ms (backward ms): Qwen3 1.29 -> 1.07
    # (2.99 -> 2.80), OLMoE 1.51 -> 1.38 (3.52 -> 3.27), DeepSeek-V3 15.6 -> 13.8 (27.95 ->
    # 26.96), Mixtral 9.53 -> 8.74 (19.38 -> 19.21); 128x128 tiles with 4 stages were slower.
    if not ws:
        return cfg
    cfg = replace(cfg, wg_ws=True, wg_n=256, wg_stages=3)
    if fwd.block_m == 128 and rows_per_expert >= 256 and 0 < inter_size <= 1024:
        # dA and dx on the warp-specialised row GEMM (dA's float32 tile 128 wide: a 256-wide
        # one needs 279 KB of shared memory). H200, NOTES.md entry 24, T=8192 backward ms:
        # Qwen3 3.01 -> 2.89 and 2.99 -> 2.88 (two runs), OLMoE 3.40 -> 3.37; on the wide
        # shapes it does not pay: Mixtral 19.41 -> 19.36, DeepSeek-V3 27.33 -> 27.47.
        cfg = replace(cfg, rows_ws=True, da_n=128)
    return cfg
