"""Kernel configurations from shapes alone (pure functions; no autotuning at call time, which
cannot run inside CUDA-graph capture)."""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from moe_ops import _env
from moe_ops.tuning import tables
from moe_ops.tuning.configs import (ActivationGradConfig, BackwardConfig, DispatchConfig,
                                    QuantDispatchConfig, RowGemmConfig, WeightGradConfig,
                                    constrain, constraints_generation)


def dispatch_config(T: int, E: int, K: int, H: int, I: int, device_type: str,
                    dtype: torch.dtype) -> DispatchConfig:
    """A tuned config for this device and shape when a table has one (moe_ops.tuning.tables),
    else the heuristic below. Memoised: every moe.dispatch call asks, and building a config
    (the heuristic's chain of dataclasses.replace, the table's nearest-T search) cost ~35 us of
    host time per call (docs/design.md, host overhead). The key holds what the answer depends
    on: the shape, the device's name, the tuning folder, the tables written in this process and
    the config constraints (moe_ops.tuning.configs)."""
    if device_type == "cuda":
        return _cached_config(T, E, K, H, I, device_type, dtype, _device_name(),
                              _env.tuning_dir(), tables.generation(), constraints_generation())
    return _cached_config(T, E, K, H, I, device_type, dtype, None, None, 0,
                          constraints_generation())


@functools.lru_cache(maxsize=4096)
def _cached_config(T, E, K, H, I, device_type, dtype, device_name, tuning_dir, _tables,
                   _constraints) -> DispatchConfig:
    if device_type == "cuda":
        tuned = tables.lookup(T, E, K, H, I, dtype, device_name, tuning_dir)
        if tuned is not None:
            return constrain(tuned)
    return constrain(heuristic_config(T, E, K, H, I, device_type, dtype))


def clear_config_cache() -> None:
    """Forget memoised configs (after a tuned table changed on disk)."""
    _cached_config.cache_clear()
    _cached_quant_config.cache_clear()
    _backward_config.cache_clear()


def quant_weights_name(fmt: str, quant_a: bool, mma: bool) -> str:
    """The tuned tables' name of a quantized weight format (moe-ops-bench's --weights values):
    "fp8" (W8A8), "fp8-w8a16", "mxfp4" or "mxfp4-mma" (mxfp4_layout="mma")."""
    if fmt == "fp8":
        return "fp8" if quant_a else "fp8-w8a16"
    return "mxfp4-mma" if mma else "mxfp4"


def quant_dispatch_config(T: int, E: int, K: int, H: int, I: int, fmt: str, bk: int,
                          device_type: str, quant_a: bool = False, *,
                          dtype: torch.dtype | None = None, mma: bool = False,
                          bn: int | None = None) -> QuantDispatchConfig:
    """The quantized expert GEMMs' config: on CUDA, with `dtype` (hidden's) given, the tuned
    table's entry for this shape, weight format (quant_weights_name) and FP8 block shape
    [bn, bk] when there is one (moe-ops-tune --weights), else quant_heuristic_config; with the
    config constraints applied. Memoised like dispatch_config."""
    if device_type == "cuda" and dtype is not None:
        return _cached_quant_config(T, E, K, H, I, fmt, bk, quant_a, dtype, bool(mma), bn,
                                    _device_name(), _env.tuning_dir(), tables.generation(),
                                    constraints_generation())
    return constrain(quant_heuristic_config(T, E, K, H, I, fmt, bk, device_type, quant_a))


@functools.lru_cache(maxsize=4096)
def _cached_quant_config(T, E, K, H, I, fmt, bk, quant_a, dtype, mma, bn, device_name,
                         tuning_dir, _tables, _constraints) -> QuantDispatchConfig:
    tuned = tables.lookup(T, E, K, H, I, dtype, device_name, tuning_dir,
                          weights=quant_weights_name(fmt, quant_a, mma),
                          block_shape=[bn, bk] if fmt == "fp8" else None)
    if tuned is not None:
        return constrain(tuned)
    return constrain(quant_heuristic_config(T, E, K, H, I, fmt, bk, "cuda", quant_a))


@functools.lru_cache(maxsize=None)
def _device_name() -> str:
    return torch.cuda.get_device_name()


def heuristic_config(T: int, E: int, K: int, H: int, I: int, device_type: str,
                     dtype: torch.dtype) -> DispatchConfig:
    if device_type != "cuda":
        # Interpreter: numpy runs each program; few large-ish blocks keep tiny tests fast.
        return DispatchConfig(block_m=16, gate_up_block_n=32, gate_up_block_k=32, down_block_n=32,
                              down_block_k=32, num_warps=4, num_stages=1)
    rows_per_expert = T * K / max(E, 1)
    # Small batches: one row block per expert, so each expert's weights stream once. Routed
    # counts scatter around the mean (~Poisson), so the block is sized for mean + 2 sd: with
    # BLOCK_M at the mean, half the experts took two blocks and read their weights twice. H200
    # sweep (docs/design.md): Mixtral T=128 (32 rows/expert) 796 -> 697 us with
    # BLOCK_M 64 instead of 32; DeepSeek-V3 T=512 (16 rows) 5966 -> 5138 us with 32 instead of
    # 16; T=2048 (64 rows) 6471 -> 6255 us with 128 instead of 64.
    need = rows_per_expert + 2.0 * rows_per_expert ** 0.5
    block_m = 16 if need <= 16 else 32 if need <= 32 else 64 if need <= 64 else 128
    wide = dtype == torch.float32
    if block_m <= 64:
        # Weight-streaming: 4-warp programs, 128-deep steps. A 128-wide down tile when it still
        # leaves a program per SM: at BLOCK_M <= 32 on wide hidden sizes only (Mixtral T=8:
        # 604 -> 570 us; DeepSeek-V3 T=512: -0.5%; Qwen3 zipf T=512 at BLOCK_M 32, H = 2048:
        # +7%), at BLOCK_M 64 on any H (H200: Qwen3 zipf T=512 445 -> 397 us, Mixtral T=128
        # 712 -> 690 us).
        row_blocks = max(min(E, T * K), T * K / block_m)
        wide_down = (block_m == 64 or H >= 4096) and row_blocks * H / 128 >= 132
        cfg = DispatchConfig(block_m=block_m, gate_up_block_n=64, gate_up_block_k=128,
                             down_block_n=128 if wide_down else 64, down_block_k=128,
                             num_warps=4, num_stages=4)
    else:
        # H200 sweeps (docs/design.md): 128x(2*128) gate+up tiles, 8 warps, 3
        # stages. A 256-wide down tile pays on Mixtral's long down reduction (I = 14336: T=512
        # 1152 -> 1128 us, T=8192 10.9 -> 10.5 ms) and costs on DeepSeek-V3 (I = 2048, +4%).
        # With TMA weight tiles (below) a 4th stage pays up to T=2048 and costs at T=8192
        # (H200: Mixtral T=2048 2775 -> 2707 us, T=8192 9752 -> 11983 us).
        # Also on wide H with >= 256 rows per expert (H200: DeepSeek-V3 T=8192 13383 ->
        # 13018 us with TMA, 14695 -> 14096 without).
        n2 = 256 if I >= 8192 or (H >= 4096 and rows_per_expert >= 256) else 128
        # Tail row blocks with <= 64 valid rows on a 64-row tile (H200: 0.5-4%
        # in each of 8 prefill cells, e.g. OLMoE T=2048 561 -> 537 us, Qwen3 T=8192 1483 ->
        # 1445).
        cfg = DispatchConfig(block_m=block_m, gate_up_block_n=128, gate_up_block_k=64,
                             down_block_n=n2, down_block_k=64, num_warps=8,
                             num_stages=4 if T <= 4096 else 3, half_height_tails=True)
    if wide:
        # float32 tiles take twice the shared memory per stage.
        cfg = replace(cfg, gate_up_block_k=32, down_block_k=32, num_stages=3)
    else:
        # Weight tiles through TMA descriptors (16-bit weights; float32 never measured). H200,
        # Mixtral T=512/2048/8192 -4/-4/-6%, DeepSeek-V3 T=8192 -6%, 0 to -1.5% at
        # BLOCK_M <= 64.
        cfg = replace(cfg, tma_weights=True)
        if block_m == 16 and T > 1 and E >= 64:
            # Many small experts, several tokens: 32-wide gate+up strips (twice the programs,
            # a finer last wave) in 256-deep steps, 3 stages (the same bytes in flight). H200,
            # H200, graph replay: Qwen3 T=8 138.4 -> 135.9 us, OLMoE T=8 146.9 ->
            # 139.2, Qwen3 zipf T=8 106.8 -> 102.0, T=32/128 -0.6 to -1.7%, DeepSeek-V3 T=8
            # -1.1%; at T=1 (8 experts x 24 strips: 1.45 waves) +1.7 us, Mixtral +0.2-0.4%.
            # (num_stages is shared: the down GEMM runs 3 stages too, as measured.)
            cfg = replace(cfg, gate_up_block_n=32, gate_up_block_k=256, num_stages=3)
        if block_m == 128:
            # Gate and up tiles in one TMA copy and one N=256 product, and 256-wide down tiles
            # on every shape (H200, graph replay: the pair -0.5 to -6% in 10 of 11 prefill
            # cells, Mixtral T=8192 9326 -> 8826 us, DeepSeek-V3 T=8192 12761 -> 11974; the
            # 256-wide down tile -4 to -8% on the H = 2048 shapes at T <= 2048, e.g. Qwen3
            # T=2048 489 -> 452, and DeepSeek-V3 T=2048 6047 -> 5749; Qwen3 T=8192 +1.7%,
            # within the spread).
            # The down GEMM's act tiles through TMA too (contiguous aligned rows; H200,
            # graph replay: Qwen3 T=2048/8192 468 -> 461 / 1354 -> 1285 us, OLMoE
            # T=2048 473 -> 462, Mixtral T=512 1032 -> 1018; Mixtral and DeepSeek-V3 T=8192
            # within +-0.3%; at BLOCK_M <= 64 0.1-1.6% slower in 8 of 8 decode cells).
            cfg = replace(cfg, tma_gate_up_pair=True, down_block_n=256, tma_down_activations=True)
    # Programmatic dependent launch (sm_90+; ignored elsewhere): each kernel's launch overlaps
    # its predecessor's tail (H200: Qwen3 T=1 36.5 -> 35.5 us, T=8 142.4 -> 140.6, OLMoE
    # T=1 43.5 -> 42.3; 0.3-1 us on the other cells measured).
    cfg = replace(cfg, dependent_launch=True)
    # One token: no alignment launch (H200: Qwen3 T=1 40.6 -> 37.6 us). The combine folded
    # into the down GEMM pays only where its grid (one program per 32 columns of H) still covers
    # the SMs at least 1.5 times over: DeepSeek-V3 T=1 183 -> 177 us; Qwen3/OLMoE (64 programs)
    # +6/+11%, Mixtral (128) +2%.
    # Elsewhere at T=1 the down kernel's last program per H tile does the combine (H200:
    # Qwen3 34.5 -> 34.1 us, OLMoE 42.0 -> 41.2, Qwen3 zipf 35.7 -> 34.9, Mixtral unchanged).
    # A few tokens over many experts (T * K <= 32, E >= 64, 16-bit): direct rows as well, slot s
    # as row block s, no alignment launch. Slots that share an expert read its weight tiles again
    # (from L2: the grids walk column tiles with every slot together), which costs ~1/4 of a
    # weight-streaming program each; with up to ~20% of the slots shared (uniform routing at
    # T * K <= 32 on 64+ experts) that is less than the ~7 us alignment launch, with ~30% and
    # more it is not. H200, graph replay (docs/design.md): T=2 Qwen3 56.8 -> 54.0 us,
    # zipf 53.6 -> 48.9, OLMoE 63.5 -> 60.9, DeepSeek-V3 336.5 -> 333.1; T=4 Qwen3 89.8 ->
    # 86.8, OLMoE 95.5 -> 93.1, DeepSeek-V3 611.1 -> 604.5, zipf 65.1 -> 66.3; T=8 Qwen3 and
    # DeepSeek-V3 +0.4 / +0.2%, OLMoE +9%; Mixtral (8 experts) T=2 +6%.
    if 1 < T and T * K <= 32 and E >= 64 and not wide:
        cfg = replace(cfg, direct_rows=True)
    if T == 1:
        cfg = replace(cfg, direct_rows=True)
        if not wide and H >= 32 * 198:
            cfg = replace(cfg, down_combine_fused=True, down_block_n=32, down_block_k=256)
        else:
            cfg = replace(cfg, combine_in_down=True)
            if not wide and I >= 8192:
                # Long weight streams per program (the down GEMM's I-long rows, one program per
                # 64 columns of H on ~128 SMs): a 5th stage keeps more bytes in flight per SM.
                # H200, H200, graph replay, two runs: Mixtral T=1 193.6 -> 183.3,
                # 193.8 -> 183.1 us (6 stages 183.9); not at T=8 (576 -> 591), nor on the short
                # streams of Qwen3 / OLMoE T=1 (+0.4-0.8 us) or DeepSeek-V3's folded combine
                # (176.5 -> 181.3).
                cfg = replace(cfg, num_stages=5)
    return cfg


def neighbours(base: DispatchConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, DispatchConfig]:
    """A dozen variants of a heuristic config, named: the ones the H200 sweeps of
    docs/design.md found to matter per regime. moe-ops-tune
    times them; `moe-ops-tune --quick` picks the best of them per token count (~10
    candidates instead of ~100). float32 variants keep 32-deep steps and <= 3 stages (shared
    memory). Duplicates of the base or of each other are dropped; the base comes first."""
    r = replace
    if base.block_m <= 32:
        cands = {
            "s5": r(base, num_stages=5),
            "gate/up n128": r(base, gate_up_block_n=128, gate_up_block_k=64),
            "gate/up n32": r(base, gate_up_block_n=32),
            "gate/up n32 k256 s3": r(base, gate_up_block_n=32, gate_up_block_k=256, num_stages=3),
            "k256 s3": r(base, gate_up_block_k=256, down_block_k=256, num_stages=3),
            "down n128": r(base, down_block_n=128),
            "down n64": r(base, down_block_n=64),
            "bm/2": r(base, block_m=max(16, base.block_m // 2)),
            "bm*2": r(base, block_m=base.block_m * 2),
            "w8": r(base, num_warps=8),
        }
    elif base.block_m == 64:
        cands = {
            "gate/up n128": r(base, gate_up_block_n=128, gate_up_block_k=64),
            "gate/up n128 w8 s3": r(base, gate_up_block_n=128, gate_up_block_k=64, num_warps=8, num_stages=3),
            "down n128": r(base, down_block_n=128),
            "bm 32": DispatchConfig(
                block_m=32, gate_up_block_n=64, gate_up_block_k=128, down_block_n=64, down_block_k=128, num_warps=4, num_stages=4),
            "bm 128": DispatchConfig(
                block_m=128, gate_up_block_n=128, gate_up_block_k=64, down_block_n=128, down_block_k=64, num_warps=8, num_stages=3),
        }
    else:
        cands = {
            "g16": r(base, group_m=16),
            "g4": r(base, group_m=4),
            "down n256" if base.down_block_n != 256 else "down n128": r(
                base, down_block_n=256 if base.down_block_n != 256 else 128),
            "bm 64": DispatchConfig(
                block_m=64, gate_up_block_n=128, gate_up_block_k=64, down_block_n=128, down_block_k=64, num_warps=8, num_stages=3),
            "bm 64 w4 s4": DispatchConfig(
                block_m=64, gate_up_block_n=64, gate_up_block_k=64, down_block_n=128, down_block_k=64, num_warps=4, num_stages=4),
        }
    cands["no tma" if base.tma_weights else "tma"] = r(base, tma_weights=not base.tma_weights)
    cands["no tma a" if base.tma_down_activations else "tma a"] = r(base, tma_down_activations=not base.tma_down_activations)
    if base.block_m == 16:
        cands["no direct" if base.direct_rows else "direct"] = r(base, direct_rows=not base.direct_rows)
    if base.direct_rows:
        fc = not base.down_combine_fused
        cands["fused" if fc else "unfused"] = r(base, down_combine_fused=fc)
        cands["fused n16" if fc else "n16"] = r(base, down_combine_fused=True, down_block_n=16)
        cands["fused n16 k256" if fc else "n16 k256"] = r(base, down_combine_fused=True, down_block_n=16,
                                                           down_block_k=256)
        cands["fused n32" if fc else "n32"] = r(base, down_combine_fused=True, down_block_n=32)
        cands["fused n32 k256" if fc else "n32 k256"] = r(base, down_combine_fused=True,
                                                           down_block_n=32, down_block_k=256)
    cands["no pdl" if base.dependent_launch else "pdl"] = r(base, dependent_launch=not base.dependent_launch)
    if base.direct_rows and not base.down_combine_fused:
        cands["combine kernel" if base.combine_in_down else "combine last"] = r(
            base, combine_in_down=not base.combine_in_down)
    if base.block_m >= 64:
        cands["no half tail" if base.half_height_tails else "half tail"] = r(base,
                                                                     half_height_tails=not base.half_height_tails)
    if base.tma_weights:
        cands["tma unpaired" if base.tma_gate_up_pair else "tma pair"] = r(base, tma_gate_up_pair=not base.tma_gate_up_pair)
    if base.block_m == 128:
        cands["s3" if base.num_stages != 3 else "s4"] = r(
            base, num_stages=3 if base.num_stages != 3 else 4)
    out = {"heuristic": base}
    seen = {base}
    for name, cfg in cands.items():
        if dtype == torch.float32:
            cfg = r(cfg, gate_up_block_k=min(cfg.gate_up_block_k, 32),
                    down_block_k=min(cfg.down_block_k, 32),
                    num_stages=min(cfg.num_stages, 3))
        if cfg not in seen:
            seen.add(cfg)
            out[name] = cfg
    return out


def backward_config(fwd: DispatchConfig, device_type: str, dtype: torch.dtype,
                    rows_per_expert: float = 0.0, inter_size: int = 0) -> BackwardConfig:
    """rows_per_expert: the mean aligned rows per expert, T*K/E (0: unknown, as for large T);
    inter_size: the experts' I (0: unknown). Memoised (every backward asks; building the
    config costs host time), with the config constraints in the key."""
    return _backward_config(fwd, device_type, dtype, rows_per_expert, inter_size,
                            constraints_generation())


@functools.lru_cache(maxsize=4096)
def _backward_config(fwd: DispatchConfig, device_type: str, dtype: torch.dtype,
                     rows_per_expert: float, inter_size: int, _constraints) -> BackwardConfig:
    return constrain(_backward_heuristic(fwd, device_type, dtype, rows_per_expert, inter_size))


def _backward_heuristic(fwd, device_type, dtype, rows_per_expert, inter_size) -> BackwardConfig:
    if device_type != "cuda":
        # Interpreter: small tiles keep the tiny CPU tests fast.
        return BackwardConfig(
            activation_grad_gemm=RowGemmConfig(block_n=32, block_k=32, num_warps=1, num_stages=1),
            input_grad_gemm=RowGemmConfig(block_n=32, block_k=32, num_warps=1, num_stages=1),
            weight_grad=WeightGradConfig(block_m=32, block_n=32, block_k=16, num_warps=1,
                                         num_stages=1),
            activation_grad=ActivationGradConfig(rows_per_program=16, block_i=32))
    big = fwd.block_m >= 128
    # H200 sweeps at T=8192 (docs/design.md, backward): 128x256x64 weight-gradient tiles with
    # 4 stages (Mixtral 22.4 -> 19.9 ms backward, DeepSeek-V3 33.5 -> 32.1, Qwen3 3.49 -> 3.17,
    # OLMoE 3.88 -> 3.53), 256-wide dx and dA tiles.
    rows = RowGemmConfig(block_n=256 if big else 128, block_k=64, num_warps=8 if big else 4,
                         num_stages=4)
    wg = WeightGradConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
    # elementwise pass: 256 columns of I per step (H200, T=8192: 512 -> 256 took the pass from
    # 0.25-0.27 to 0.18 ms on Qwen3, 0.30 -> 0.24 OLMoE, 0.62 -> 0.55 DeepSeek-V3)
    ew = ActivationGradConfig(rows_per_program=4, block_i=256)
    if dtype == torch.float32:
        # float32 tiles take twice the shared memory per stage.
        rows = replace(rows, block_n=128, block_k=32, num_stages=3)
        return BackwardConfig(activation_grad_gemm=rows, input_grad_gemm=rows,
                              weight_grad=replace(wg, block_n=128, block_k=32, num_stages=3),
                              activation_grad=ew)
    # The dA and dx GEMMs' A tiles (gathered dO rows, dz rows) through TMA where I is narrow
    # (T=8192 row-GEMM kernel ms: Qwen3 1.11 -> 1.09; Mixtral 8.60 -> 8.80; the whole backward
    # within +-1% on Qwen3/OLMoE over 3 rounds: neutral, kept as measured in the training tables).
    if 0 < inter_size <= 1024:
        rows = replace(rows, tma_activations=True)
    # Persistent weight gradients (3 stages: the store's staging tile takes the 4th). They beat
    # the per-tile kernel at every T measured (backward ms, per-tile -> persistent, T =
    # 2048/8192/32768): Qwen3 1.12/2.93/10.34 -> 1.11/2.86/10.21, OLMoE 1.12/3.35/12.86 ->
    # 1.09/3.19/12.55, Mixtral 5.89/19.75/77.01 -> 5.50/19.37/74.56, DeepSeek-V3
    # 14.09/28.88/89.16 -> 13.94/26.64/84.18.
    # The LPT deal: largest experts' tiles first in snaking rounds where the routing is skewed
    # (largest expert > 2x the mean rows, decided in the kernel), else the fixed deal. H200,
    # T=8192, backward ms fixed -> LPT: Qwen3 zipf 3.017 -> 2.844; near-uniform shapes within
    # run-to-run spread (DeepSeek-V3 26.59 -> 26.60, OLMoE 3.309 -> 3.324).
    wg = replace(wg, persistent=True, persistent_num_stages=3, lpt_schedule=True)
    return BackwardConfig(activation_grad_gemm=rows, input_grad_gemm=rows, weight_grad=wg,
                          activation_grad=ew)


def quant_heuristic_config(T: int, E: int, K: int, H: int, I: int, fmt: str, bk: int,
                           device_type: str, quant_a: bool = False) -> QuantDispatchConfig:
    """The built-in tiles of the quantized expert GEMMs. Row blocks from the mean rows per expert (decode: 16,
    so few padding rows are multiplied); K step bk for FP8, 128 values (64 packed bytes) for
    MXFP4. The interpreter gets the smallest tiles tl.dot takes (runtime grows with tile area)."""
    if device_type != "cuda":
        return QuantDispatchConfig(block_m=16, block_n1=bk if quant_a else 16, block_n2=32,
                                   block_k=bk if fmt == "fp8" else 32 if H <= 32 or I <= 32 else 64,
                                   group_m=4, num_warps=1, num_stages=1)
    rows = T * K / max(E, 1)
    block_m = 16 if rows <= 16 else 32 if rows <= 48 else 64
    block_k = bk if fmt == "fp8" else 128
    if fmt == "mxfp4" and rows >= 128:
        # prefill: 128-row blocks decode each weight tile for twice the rows, the products
        # computed transposed with 4 warps, 64-wide K steps: 1.07-1.15x of the same with
        # 128-wide steps and 1.12-1.54x of 64-row blocks at gpt-oss-20b/120b T=512..8192 on
        # the H100 (docs/design.md). From 128 rows per expert: at 64 (gpt-oss-20b T=512,
        # gpt-oss-120b T=2048) half of each 128-row block is padding, and the 64-row tiles
        # below measure 1.05-1.06x (H100: 611.6 -> 580.5 us, 2268.6 -> 2139.8 us, bit-equal);
        # at 256 rows they are 0.85-0.87x.
        return QuantDispatchConfig(block_m=128, block_n1=64, block_n2=128, block_k=64,
                                   group_m=8, num_warps=4, num_stages=3, mxfp4_swap_ab=True,
                                   dependent_launch=False)
    if fmt == "mxfp4":
        # Below 64 rows per expert: transposed too, 64-wide weight tiles, so that every T runs
        # wgmma (64 weight rows as the MMA's M); mma.sync sums the decoded tile in another order
        # (relative difference 3e-5..1e-4), which made a token's output depend on the batch.
        # H100, against the earlier untransposed 32/64-wide tiles: gpt-oss-20b T=1 76.8 -> 85.0
        # us (0.90x), T=8/32/128 1.02/1.03/1.04x; 64-wide K steps from T=32 on (1.03-1.05x;
        # at T=1 0.77x).
        # With at most 64 slots (T * K; few experts hit, a few hundred programs), gate and up
        # rows are decoded as one [64, block_k] tile of 32 gate + 32 up rows (the MMA's M
        # stays 64, the same sums: bit-equal), which gives twice the programs at 80 registers
        # instead of 171 (ptxas, sm_90, the launch at T=1 and 8). H100, graph replay:
        # gpt-oss-20b T=1 81.7 -> 75.5 us (1.08x), T=8 253.2 -> 232.0 (1.09x); at 512 slots
        # (T=128) 0.97x.
        # At <= 4 slots (gpt-oss T=1), 256-value K steps: half the K steps, the same MMA chain
        # (bit-equal). H200, graph replay: gpt-oss-20b and -120b T=1 74.6 -> 68.7 us (1.09x);
        # at 8 slots (T=2) 0.92-0.93x, so not beyond 4.
        stacked = T * K <= 64
        block_k = 256 if T * K <= 4 else 64 if T >= 32 else 128
        return QuantDispatchConfig(block_m=block_m, block_n1=32 if stacked else 64, block_n2=64,
                                   block_k=block_k, group_m=8, num_warps=4,
                                   num_stages=3, mxfp4_swap_ab=True,
                                   mxfp4_stacked_gate_up=stacked, dependent_launch=False)
    if fmt == "fp8":
        # wgmma tiles and 8 warps at every T: Hopper's FP8 wgmma (64-row tiles) and mma.sync
        # (16/32-row tiles) round their float32 sums differently (relative difference 5e-3 on
        # the H100), so one MMA kind at every T keeps a token's output independent of the batch;
        # at decode this costs 0-3% (H100: Qwen3-30B-A3B T=1/8/128 41.9/120.5/252.8 ->
        # 41.8/124.5/260.0 us, DeepSeek-V3 T=1/128 155.9/3861 -> 153.6/3872). The gate+up tile
        # is one bk group of the activation it quantizes (128 columns: two [64, 128] float32
        # accumulators). Four stages: one more K step in flight, the same sums (bit-equal);
        # H100, two runs: Qwen3-30B-A3B T=1 40.5 -> 37.8 us, T=8 1.02x, T=2048 1.04x, T=8192
        # 1.01x; DeepSeek-V3 T=1 1.01x, T=2048 4752 -> 4585 us. From 256 rows per expert,
        # 128-row blocks (two 64-row wgmma halves, the same sums: outputs bit-equal to the
        # 64-row tiles): each weight tile is read for twice the rows. H100, same run:
        # DeepSeek-V3 T=8192 (256 rows) 1.14x, Qwen3-30B-A3B T=8192 (512 rows) 1.06x; at 64
        # and 128 rows (DeepSeek-V3 / Qwen3 T=2048) 1.00x / 0.98x, so not below 256. W8A8 only
        # (the weight-only path's 128-row tiles are not measured).
        # At <= 8 rows per expert (W8A8), the products transposed (fp8_swap_ab) with 16-row
        # blocks: the rows are the wgmma's N (m64n16k32) instead of a 64-row tile of padding;
        # the same sums (bit-equal to the 64-row tiles at T = 1..2048 on the H200, so the
        # same class). H200, graph replay: Qwen3-30B-A3B T=1/8/128 1.04/1.08/1.08x,
        # DeepSeek-V3 T=1/8/128 1.01/1.03/1.02x; at 16 rows per expert (DeepSeek-V3 T=512)
        # 0.94x (H100), at 128 rows 0.44-0.48x.
        if quant_a and rows <= 8:
            return QuantDispatchConfig(block_m=16, block_n1=bk, block_n2=128, block_k=block_k,
                                       group_m=8, num_warps=4, num_stages=4, fp8_swap_ab=True)
        return QuantDispatchConfig(block_m=128 if quant_a and rows >= 256 else 64,
                                   block_n1=bk if quant_a else 64, block_n2=128,
                                   block_k=block_k, group_m=8, num_warps=8, num_stages=4)
    return QuantDispatchConfig(block_m=block_m, block_n1=64, block_n2=128, block_k=block_k,
                               group_m=8, num_warps=4 if block_m < 64 else 8,
                               num_stages=3)
