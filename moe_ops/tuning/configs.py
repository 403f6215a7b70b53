"""Kernel configurations (keyword-only, frozen dataclasses) and the one API through which
experiments and tools constrain them.

Every launcher takes its config as an argument; the heuristics (moe_ops.tuning.heuristics) and
tuned tables (moe_ops.tuning.tables) produce them from shapes alone. To try other values without
editing code, constrain the fields (as triton_kernels' update_opt_flags_constraints does):

    from moe_ops.tuning import DispatchConfig, config_constraints
    with config_constraints(DispatchConfig, dependent_launch=False):
        out = moe_ops.dispatch(...)

Constraints apply to every config of that class the heuristics or tables return (nested ones
included) until reset; a config passed explicitly to a launcher is used as given."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """The forward of moe.dispatch (moe_ops.launch.dispatch)."""
    block_m: int                 # rows per row block of the alignment (tokens of one expert)
    gate_up_block_n: int         # gate+up GEMM: columns of I per program
    gate_up_block_k: int         # gate+up GEMM: reduction step over H
    down_block_n: int            # down GEMM: columns of H per program
    down_block_k: int            # down GEMM: reduction step over I
    num_warps: int
    num_stages: int
    group_m: int = 8             # row blocks that walk the column tiles together (L2 reuse)
    tma_weights: bool = False    # weight tiles through tensor descriptors (where the layout allows)
    direct_rows: bool = False    # few slots: slot s is row block s, no alignment launch
    down_combine_fused: bool = False   # T == 1, direct rows: down GEMM and combine in one kernel
    dependent_launch: bool = False     # programmatic dependent launch of the kernels (sm_90+)
    tma_gate_up_pair: bool = False     # with tma_weights: gate and up tiles in one copy
    half_height_tails: bool = False    # tail row blocks (<= block_m/2 valid rows) on half tiles
    combine_in_down: bool = False      # T == 1, direct rows: the down kernel's last program combines
    tma_down_activations: bool = False  # down GEMM: the activation tiles through TMA too


@dataclass(frozen=True, kw_only=True)
class RowGemmConfig:
    """A backward row GEMM: dA = dO W2_e (columns of I) or dx = dz W13_e (columns of H)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma_activations: bool = False   # the gathered A rows through tensor descriptors


@dataclass(frozen=True, kw_only=True)
class WeightGradConfig:
    """The weight gradients dW13_e and dW2_e (sums over each expert's rows)."""
    block_m: int                 # output tile rows
    block_n: int                 # output tile columns
    block_k: int                 # expert rows per step
    num_warps: int
    num_stages: int
    persistent: bool = False     # one program per SM walking output tiles (16-bit, sm_90+)
    persistent_num_stages: int = 0   # pipeline stages of the persistent loop (0: num_stages)
    persistent_chunk: int = 32   # persistent: output tiles per bookkeeping chunk (2^n, <= 32)
    lpt_schedule: bool = False   # persistent: largest experts' tiles first where routing is skewed


@dataclass(frozen=True, kw_only=True)
class ActivationGradConfig:
    """The elementwise pass from dA and z to dz, s*a and d topk_weights."""
    rows_per_program: int = 4
    block_i: int = 256           # columns of I per step


@dataclass(frozen=True, kw_only=True)
class BackwardConfig:
    """The backward of moe.dispatch (moe_ops.launch.dispatch_backward); its row block is the
    forward config's block_m (the backward walks the same alignment)."""
    activation_grad_gemm: RowGemmConfig   # dA = dO W2_e
    input_grad_gemm: RowGemmConfig        # dx = dz W13_e
    weight_grad: WeightGradConfig
    activation_grad: ActivationGradConfig = ActivationGradConfig()
    # dW13 in column chunks of H (x gathered one chunk at a time), so that its stage holds
    # x/x_chunks instead of all of x gathered: the same sums, less peak memory. 1: one chunk;
    # 0 (default): automatic (moe_ops.launch.dispatch_backward.x_chunks: two where gathered x
    # is more than half of dz)
    x_chunks: int = 0


@dataclass(frozen=True, kw_only=True)
class AlignmentConfig:
    """The alignment kernels (moe_ops.launch.alignment)."""
    tile_elems: int = 8192       # count/place programs walk [CHUNK, E] one-hot tiles of ~this size
    scan_elems: int = 16384      # at most scan_elems / E two-launch programs (one histogram tile)
    scan_warps: int = 4          # warps of the one-launch scan
    # three launches (count, column scan, place) where two-launch programs would walk at least
    # this many chunks each (docs/design.md, alignment: Qwen3-30B-A3B T=8192 58 -> 32 us)
    columns_min_chunks: int = 2
    max_column_programs: int = 4096
    column_scan_block: int = 1024
    # two-launch place: in-chunk ranks by a triangular compare where CHUNK <= this (10-20% faster
    # there than the cumulative sum)
    triangular_rank: bool = True
    triangular_max_chunk: int = 128


@dataclass(frozen=True, kw_only=True)
class QuantDispatchConfig:
    """Tiles of the quantized expert GEMMs. block_k: the K step (FP8: equal to the block
    shape's bk, one weight scale per step; MXFP4: a multiple of 32). block_n1 counts columns of
    I (the gate+up kernel computes a gate and an up tile of that width)."""
    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # MXFP4 through tl.dot_scaled instead of the kernels' own decode (bf16/fp16 activations,
    # where has_dot_scaled()); off: 0.59-0.86x of the bit-placement decode on the H200 (design.md)
    mxfp4_dot_scaled: bool = False
    # MXFP4 decoded by bit placement (quant_gemm.mxfp4_tile_bits; GPU, bfloat16 activations)
    mxfp4_bit_decode: bool = True
    # the bit-placement decode written in inline PTX over bf16x2 pairs (quant_gemm.mxfp4_tile_asm:
    # one byte gives one MMA operand register, packed multiplications); with mxfp4_bit_decode,
    # where _features.inline_ptx (sm_90+). H100: 1.07-1.21x at gpt-oss-20b/120b T=1..8192
    # (docs/design.md)
    mxfp4_asm_decode: bool = True
    # MXFP4 products computed transposed (decoded weights x rows^T): the decoded tile is the
    # MMA's left operand, which Hopper's wgmma reads from registers (no trip through shared
    # memory); the row block becomes the MMA's N (8..256), so decode tiles stay small
    mxfp4_swap_ab: bool = False
    # FP8: one scalar weight scale per K step when every row of a tile is in one [bn, bk] block
    # row (gate+up: bn and I multiples of block_n1, not interleaved; down: bn a multiple of
    # block_n2)
    scalar_weight_scale: bool = True
    # each K step's weight scales (FP8 block scales, MXFP4 e8m0 bytes) and W8A8 activation
    # scales loaded one step ahead (quant_gemm.step_scales): Triton's pipeliner copies the
    # tiles asynchronously but leaves these loads (scalars, gathers, MXFP4's scale rows that
    # are not 4-byte aligned) synchronous in the step that uses them. Not for MXFP4's plain
    # layout where _features.mxfp4_plain_scale_prefetch_safe() is False (Triton >= 3.7: the
    # launcher ignores the flag there; docs/design.md)
    prefetch_scales: bool = True
    # W8A8: hidden quantized once per token (quantize_groups_kernel) instead of in every gate+up
    # program's gather (not with weights_on_input, whose rows are scaled per slot first);
    # 1.02-1.48x on the H200 (docs/design.md)
    prequantize_hidden: bool = True
    # W8A8: the gate+up GEMM stores the activation in float32 and the down GEMM quantizes it in
    # its gather (the same e4m3 values and scales as the epilogue's quantization), so block_n1
    # need not be bk: at decode, narrower gate+up tiles give more programs
    act_quant_in_down: bool = False
    # MXFP4 with mxfp4_swap_ab: the gate and up rows of a tile decoded as one [2 * block_n1,
    # block_k] tile and multiplied by one MMA chain per K step (quant_gemm: STACK_GU); the same
    # sums (bit-equal). The heuristic turns it on with block_n1 32 at <= 64 slots (decode).
    mxfp4_stacked_gate_up: bool = False
    # FP8: the products computed transposed (weight tile x rows^T): the row block becomes the
    # MMA's N, so a decode tile of 16 rows runs a 16-wide wgmma instead of a 64-row one whose
    # rows are mostly padding; the same promotion arithmetic per element
    fp8_swap_ab: bool = False
    # programmatic dependent launch (sm_90+): each kernel of the call may launch while its
    # predecessor finishes and waits for it before its first memory access. H100, graph
    # replay: FP8 Qwen3-30B-A3B T=1 36.2 -> 32.8 us (1.10x), T=8 1.03x, DeepSeek-V3 1.00-1.01x;
    # MXFP4 gpt-oss-20b T=1 75.8 -> 79.7 us (0.95x), T=8..2048 1.00x: the MXFP4 heuristics
    # turn it off
    dependent_launch: bool = True
    # MXFP4 at prefill: from this many slots per expert (T * K / E; 0: never), the call decodes
    # the experts' weights once into a 16-bit buffer (mxfp4_dequant_kernel: the GEMM kernels'
    # own tile decode, so the same values) and runs the bf16/fp16 expert kernels on it
    # (launch.dispatch.dispatch_triton) instead of decoding every weight tile once per row
    # block. Skipped where that buffer would pass MXFP4_DEQUANT_MAX_BYTES. An opt-in only: the
    # buffer is the dequantized copy of the weights that the default path never allocates
    # (docs/design.md)
    mxfp4_dequant_rows: int = 0
    # MXFP4 with the inline-PTX decode: each GEMM program reads its scale rows once before its K
    # loop and, where every e8m0 byte is <= 128 (block scales up to 2), scales
    # each decoded pair by one packed multiplication (2^(s - 1)) instead of two; the same values.
    # Off until measured on a GPU
    mxfp4_one_factor: bool = False


CONFIG_CLASSES = (DispatchConfig, RowGemmConfig, WeightGradConfig, ActivationGradConfig,
                  BackwardConfig, AlignmentConfig, QuantDispatchConfig)

_constraints: dict = {}   # config class -> {field: value}
_generation = 0           # bumped on every change (part of the memoised configs' keys)


def update_config_constraints(cls, **fields) -> None:
    """From now on, every `cls` config the heuristics or tables return has these field values."""
    global _generation
    if cls not in CONFIG_CLASSES:
        raise TypeError(f"update_config_constraints: {cls!r} is not a moe_ops config class "
                        f"({', '.join(c.__name__ for c in CONFIG_CLASSES)})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"update_config_constraints: {cls.__name__} has no field(s) {unknown}; "
                         f"its fields: {sorted(names)}")
    _constraints[cls] = {**_constraints.get(cls, {}), **fields}
    _generation += 1


def reset_config_constraints(cls=None) -> None:
    """Drop the constraints of `cls` (None: of every class)."""
    global _generation
    if cls is None:
        _constraints.clear()
    else:
        _constraints.pop(cls, None)
    _generation += 1


@contextlib.contextmanager
def config_constraints(cls, **fields):
    """update_config_constraints for the duration of a with block (the previous constraints of
    `cls` are restored after it)."""
    global _generation
    saved = dict(_constraints.get(cls, {}))
    update_config_constraints(cls, **fields)
    try:
        yield
    finally:
        if saved:
            _constraints[cls] = saved
        else:
            _constraints.pop(cls, None)
        _generation += 1


def constraints_generation() -> int:
    """Changes with every constraint update (memoised configs include it in their key)."""
    return _generation


def constrain(cfg):
    """`cfg` with the constrained fields of its class (and of nested configs) replaced."""
    if not _constraints:
        return cfg
    updates = dict(_constraints.get(type(cfg), {}))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in updates and type(value) in CONFIG_CLASSES:
            nested = constrain(value)
            if nested is not value:
                updates[f.name] = nested
    return dataclasses.replace(cfg, **updates) if updates else cfg
